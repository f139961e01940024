#include "common/log.h"

#include "absl/strings/str_cat.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace pippy::log {

void Init(const std::string& component, Level level) {
  auto logger = spdlog::get(component);
  if (logger == nullptr) logger = spdlog::stderr_color_mt(component);
  switch (level) {
    case Level::kDebug: logger->set_level(spdlog::level::debug); break;
    case Level::kInfo: logger->set_level(spdlog::level::info); break;
    case Level::kWarn: logger->set_level(spdlog::level::warn); break;
    case Level::kError: logger->set_level(spdlog::level::err); break;
    case Level::kOff: logger->set_level(spdlog::level::off); break;
  }
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %n %v");
  spdlog::set_default_logger(logger);
}

absl::Status InitWithLevel(const std::string& component, const std::string& text) {
  Level level;
  absl::Status s = ParseLevel(text, &level);
  if (!s.ok()) return s;
  Init(component, level);
  return absl::OkStatus();
}

absl::Status ParseLevel(const std::string& text, Level* level) {
  if (text == "debug") *level = Level::kDebug;
  else if (text == "info") *level = Level::kInfo;
  else if (text == "warn") *level = Level::kWarn;
  else if (text == "error") *level = Level::kError;
  else if (text == "off") *level = Level::kOff;
  else
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown log level '", text, "': use debug, info, warn, error or off"));
  return absl::OkStatus();
}

}  // namespace pippy::log
