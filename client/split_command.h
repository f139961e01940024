// `pippyctl split`: splits a TorchScript model offline and prints or writes the plan.
#ifndef PIPPY_CLIENT_SPLIT_COMMAND_H_
#define PIPPY_CLIENT_SPLIT_COMMAND_H_

namespace pippy::cli {

// Returns the process exit code: 0 success, 2 bad input, 1 internal error.
int RunSplitCommand(int argc, char** argv, int first);

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_SPLIT_COMMAND_H_
