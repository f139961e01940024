// pippyctl's commands that talk to a coordinator (submit, list, status, watch, cancel,
// fetch, workers) and `local`, which runs a coordinator and workers on this machine.
#ifndef PIPPY_CLIENT_REMOTE_COMMANDS_H_
#define PIPPY_CLIENT_REMOTE_COMMANDS_H_

#include <string>

namespace pippy::cli {

// Returns the process exit code. `coordinator` is HOST:PORT.
int RunRemoteCommand(const std::string& command, const std::string& coordinator, int argc, char** argv, int first);
int RunLocalCommand(int argc, char** argv, int first, const std::string& self_path);

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_REMOTE_COMMANDS_H_
