// The one logging wrapper (spdlog). Every line about a job, stage or micro-batch
// carries those ids as `job=… stage=… mb=…` so that logs of many workers can be
// grepped together.
//
// Thread safety: all functions may be called from any thread.
#ifndef PIPPY_COMMON_LOG_H_
#define PIPPY_COMMON_LOG_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

// Status messages (absl::string_view) go into log lines as they are.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const -> decltype(ctx.out()) {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};

namespace pippy::log {

enum class Level { kDebug, kInfo, kWarn, kError, kOff };

// Configures the process-wide logger: `component` names the program ("coordinator",
// "worker-3", "pippyctl"); lines go to stderr. Safe to call more than once.
void Init(const std::string& component, Level level = Level::kInfo);

// Init with a level given as text (a --log-level flag). Errors: INVALID_ARGUMENT.
absl::Status InitWithLevel(const std::string& component, const std::string& level);

// Parses "debug|info|warn|error|off".
absl::Status ParseLevel(const std::string& text, Level* level);

template <typename... Args>
void Debug(fmt::format_string<Args...> f, Args&&... args) {
  spdlog::debug(f, std::forward<Args>(args)...);
}
template <typename... Args>
void Info(fmt::format_string<Args...> f, Args&&... args) {
  spdlog::info(f, std::forward<Args>(args)...);
}
template <typename... Args>
void Warn(fmt::format_string<Args...> f, Args&&... args) {
  spdlog::warn(f, std::forward<Args>(args)...);
}
template <typename... Args>
void Error(fmt::format_string<Args...> f, Args&&... args) {
  spdlog::error(f, std::forward<Args>(args)...);
}

}  // namespace pippy::log

#endif  // PIPPY_COMMON_LOG_H_
