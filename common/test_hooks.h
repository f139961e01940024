// Faults the end-to-end tests inject into the daemons. They are compiled in only with
// --define=pippy_test_hooks=1, which `bazel test` sets (.bazelrc): in any other build
// (bazel build, scripts/build-nobazel, the image) Enabled() is false, the daemons do
// not even offer the hidden flags that arm them, and the hooks do nothing.
//
// Thread safety: every function may be called from any thread.
#ifndef PIPPY_COMMON_TEST_HOOKS_H_
#define PIPPY_COMMON_TEST_HOOKS_H_

#include <string>

namespace pippy::test_hooks {

bool Enabled();

// pippy-worker --test-die-in-checkpoint STEP: the process SIGKILLs itself after sending
// the first chunk of its checkpoint after STEP (a worker lost mid-checkpoint).
void SetDieInCheckpoint(int step);
void MaybeDieInCheckpoint(int step);

// pippy-coordinator --test-stall-on-job-name NAME: once a job of that name is queued,
// the coordinator's loop stops turning while it holds its lock (a stuck lock).
void SetStallOnJobName(const std::string& name);
void MaybeStallLoop(const std::string& job_id, const std::string& job_name);

}  // namespace pippy::test_hooks

#endif  // PIPPY_COMMON_TEST_HOOKS_H_
