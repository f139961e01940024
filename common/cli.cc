#include "common/cli.h"

#include "absl/strings/str_cat.h"
#include "common/proto_json.h"

#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pippy::cli {

int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kResourceExhausted:
      return kExitBadInput;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    default:
      return kExitInternal;
  }
}

namespace {
bool g_json_errors = false;
}  // namespace

void SetJsonErrors(bool json) { g_json_errors = json; }

int Fail(absl::string_view program, const absl::Status& status) {
  if (g_json_errors) {
    std::cerr << JsonError(status) << "\n";
  } else {
    std::cerr << program << ": " << status.message() << "\n";
  }
  return ExitCodeFor(status);
}

void Configure(CLI::App& app) {
  app.set_help_all_flag("--help-all", "help for every command and its options");
  app.get_formatter()->column_width(30);
}

namespace {

CLI::Validator NumberAbove(double low, bool inclusive, const std::string& name) {
  return CLI::Validator(
      [low, inclusive](std::string& text) -> std::string {
        double v = 0;
        if (!absl::SimpleAtod(text, &v)) return absl::StrCat("'", text, "' is not a number");
        if (inclusive ? v < low : v <= low) {
          return absl::StrCat("must be ", inclusive ? ">= " : "> ", low, ", got ", text);
        }
        return std::string();
      },
      name);
}

}  // namespace

CLI::Option* AddNameOption(CLI::App* app, const std::string& flag, std::string* value, const std::string& what,
                           const std::string& description, const google::protobuf::EnumDescriptor* e,
                           bool allow_auto) {
  std::vector<names::Choice> choices = names::ChoicesOf(e);
  size_t width = 0;
  for (const names::Choice& c : choices) width = std::max(width, c.name.size());
  std::string help = absl::StrCat(description, ":");
  std::vector<std::string> aliases;
  for (const names::Choice& c : choices) {
    absl::StrAppend(&help, "\n  ", c.name, std::string(width - c.name.size() + 2, ' '), c.help);
    aliases.insert(aliases.end(), c.aliases.begin(), c.aliases.end());
  }
  if (allow_auto) absl::StrAppend(&help, "\n  auto", std::string(width > 4 ? width - 4 + 2 : 2, ' '), "pippy chooses");
  if (!aliases.empty()) {
    absl::StrAppend(&help, "\n  (also: ", absl::StrJoin(aliases, ", "), "; case, - and _ do not matter)");
  }
  CLI::Validator check(
      [e, what, allow_auto](std::string& text) -> std::string {
        if (allow_auto && text == "auto") return std::string();
        absl::StatusOr<int> v = names::ParseIn(e, what, text);
        return v.ok() ? std::string() : std::string(v.status().message());
      },
      "");
  return app->add_option(flag, *value, help)->check(check);
}

CLI::Validator Positive() { return NumberAbove(0, false, "> 0"); }
CLI::Validator NonNegative() { return NumberAbove(0, true, ">= 0"); }

CLI::Validator PositiveOrAuto() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text == "auto") return std::string();
        int64_t v = 0;
        if (!absl::SimpleAtoi(text, &v) || v <= 0 || v > (int64_t{1} << 30)) {
          return absl::StrCat("'", text, "' is not a whole number > 0 or auto");
        }
        return std::string();
      },
      "N|auto");
}

std::optional<std::string> UnknownCommand(const CLI::App& root, int argc, char** argv,
                                          const std::vector<std::string>& value_options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (std::find(value_options.begin(), value_options.end(), arg) != value_options.end()) {
      ++i;  // its value
      continue;
    }
    if (arg.empty() || arg[0] == '-') continue;
    for (const CLI::App* sub : root.get_subcommands({})) {
      if (sub->get_name() == arg) return std::nullopt;
    }
    return absl::StrCat("unknown command '", arg, "'; run ", root.get_name(), " --help");
  }
  return std::nullopt;
}

std::optional<int> Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    // CLI11 says "The following argument was not expected: --x"; keep its words, add
    // the program's name and where to look.
    const std::string message = absl::StrCat(what, "; run ", app.get_name(), " --help");
    if (g_json_errors) {
      std::cerr << JsonError(absl::InvalidArgumentError(message)) << "\n";
    } else {
      std::cerr << app.get_name() << ": " << message << "\n";
    }
    return kExitBadInput;
  }
  return std::nullopt;
}

std::string FindSiblingBinary(const std::string& name, const std::string& bazel_dir) {
  char self[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    const std::filesystem::path dir = std::filesystem::path(std::string(self, static_cast<size_t>(n))).parent_path();
    for (const auto& p : {dir / name, dir / ".." / bazel_dir / name}) {
      if (std::filesystem::exists(p)) return p.string();
    }
  }
  return name;
}

std::vector<std::string> SplitList(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipEmpty());
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.1f %s", bytes, units[u]);
}

}  // namespace pippy::cli
