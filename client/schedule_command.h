// `pippyctl schedule`: generates (or reads) a pipeline schedule, validates and
// simulates it, and prints the grid, the bubble fraction and peak activations.
#ifndef PIPPY_CLIENT_SCHEDULE_COMMAND_H_
#define PIPPY_CLIENT_SCHEDULE_COMMAND_H_

namespace pippy::cli {

// Returns the process exit code: 0 success, 2 bad input or invalid schedule.
int RunScheduleCommand(int argc, char** argv, int first);

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_SCHEDULE_COMMAND_H_
