// Command-line support shared by pippyctl, pippy-coordinator, pippy-worker and
// pippy-rank: CLI11 parsing with the exit codes scripts rely on, and errors printed
// under the name of the program that failed.
//
// Exit codes (the same for every binary):
//   0  success
//   1  an internal error, or a job that did not succeed
//   2  bad input: arguments, files, models, data; the message says what to change
//   3  the coordinator (or the service a daemon needs) cannot be reached
#ifndef PIPPY_COMMON_CLI_H_
#define PIPPY_COMMON_CLI_H_

#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "proto/names.h"

namespace pippy::cli {

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitUnavailable = 3;

// The exit code for a failed `status`: bad input for INVALID_ARGUMENT, NOT_FOUND,
// FAILED_PRECONDITION, OUT_OF_RANGE, ALREADY_EXISTS, PERMISSION_DENIED and
// RESOURCE_EXHAUSTED; unreachable for UNAVAILABLE and DEADLINE_EXCEEDED; internal else.
int ExitCodeFor(const absl::Status& status);

// Prints "<program>: <message>" to stderr (or, after SetJsonErrors(true), a JSON object
// {"error": {"code": "INVALID_ARGUMENT", "message": "..."}}) and returns
// ExitCodeFor(status).
int Fail(absl::string_view program, const absl::Status& status);
// Errors (Fail's and Parse's) as JSON objects on stderr: pippyctl --output json.
void SetJsonErrors(bool json);

// Parses argv into `app` (whose name() is the program's name). Returns an exit code
// when the program should stop now: 0 after --help, 2 after a parse error (printed to
// stderr with a pointer to --help); nullopt to go on.
std::optional<int> Parse(CLI::App& app, int argc, char** argv);

// A CLI11 app with pippy's conventions: help for every flag and `--help-all` for the
// subcommands' flags too. Options show their default in --help when they are given
// one with ->capture_default_str().
void Configure(CLI::App& app);

// Validators with messages people can act on ("--stages: 'two' is not a number").
CLI::Validator Positive();     // a number > 0
CLI::Validator NonNegative();  // a number >= 0
CLI::Validator PositiveOrAuto();  // a whole number > 0, or "auto" (pippy chooses it)

// An option whose value is one of an enum's names (the table in proto/names.h): --help
// lists each name with its help, and any other value is refused naming the option and
// the names. `what` describes the option ("pipeline schedule") and names the value in
// the refusal ("unknown schedule 'x': use ...").
CLI::Option* AddNameOption(CLI::App* app, const std::string& flag, std::string* value, const std::string& what,
                           const std::string& description, const google::protobuf::EnumDescriptor* names,
                           bool allow_auto = false);
// allow_auto: "auto" is accepted too (pippy chooses the value).
template <typename E>
CLI::Option* AddNameOption(CLI::App* app, const std::string& flag, std::string* value, const std::string& what,
                           const std::string& description, bool allow_auto = false) {
  return AddNameOption(app, flag, value, what, description, google::protobuf::GetEnumDescriptor<E>(), allow_auto);
}

// If argv names a command `root` does not have ("pippyctl splat"), the error for it;
// CLI11 alone would only say that a command is required. `value_options` are the
// root's options that take a value (their values are not commands).
std::optional<std::string> UnknownCommand(const CLI::App& root, int argc, char** argv,
                                          const std::vector<std::string>& value_options);

// The path of the program `name` installed beside the running one (as an install puts
// pippyctl and the daemons in one folder), or in Bazel's output tree at
// <this binary's folder>/../<bazel_dir>/<name>; else `name` itself (found on PATH).
std::string FindSiblingBinary(const std::string& name, const std::string& bazel_dir);

// Splits "a,b,,c" into {"a","b","c"}.
std::vector<std::string> SplitList(const std::string& text);

// "1.5 KiB", "12.0 MiB", ...
std::string HumanBytes(double bytes);

}  // namespace pippy::cli

#endif  // PIPPY_COMMON_CLI_H_
