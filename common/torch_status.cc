#include "common/torch_status.h"

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pippy {

std::string TorchErrorMessage(const c10::Error& e) {
  std::string msg = e.what_without_backtrace();
  // TorchScript errors carry a source excerpt after the first line; the first
  // paragraph is what a user needs, the rest stays available in debug logs.
  std::vector<absl::string_view> lines = absl::StrSplit(msg, '\n');
  std::string out;
  for (absl::string_view line : lines) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) {
      if (!out.empty()) break;
      continue;
    }
    if (absl::StartsWith(line, "Exception raised from")) break;
    if (!out.empty()) out += " ";
    out.append(line.data(), line.size());
  }
  return out.empty() ? msg : out;
}

}  // namespace pippy
