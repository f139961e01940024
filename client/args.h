// Command-line parsing for pippyctl: `--name value`, `--name=value`, boolean
// `--name`, and positional arguments, with unknown flags reported by name.
#ifndef PIPPY_CLIENT_ARGS_H_
#define PIPPY_CLIENT_ARGS_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pippy::cli {

struct FlagSpec {
  std::string name;      // without dashes
  bool takes_value = true;
};

class Args {
 public:
  // Parses argv[first..]. Errors: INVALID_ARGUMENT naming an unknown flag or a flag
  // missing its value.
  static absl::StatusOr<Args> Parse(int argc, char** argv, int first,
                                    const std::vector<FlagSpec>& flags);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  absl::StatusOr<int> GetInt(const std::string& name, int fallback) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// Splits "a,b,,c" into {"a","b","c"}.
std::vector<std::string> SplitList(const std::string& text);

// "1.5 KiB", "12.0 MiB", ...
std::string HumanBytes(double bytes);

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_ARGS_H_
