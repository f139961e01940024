#include "common/test_hooks.h"

#include <csignal>
#include <cstdio>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace pippy::test_hooks {

#ifdef PIPPY_TEST_HOOKS
namespace {
absl::Mutex g_mu;
int g_die_in_checkpoint ABSL_GUARDED_BY(g_mu) = -1;
std::string g_stall_on_job_name ABSL_GUARDED_BY(g_mu);
}  // namespace

bool Enabled() { return true; }

void SetDieInCheckpoint(int step) {
  absl::MutexLock lock(&g_mu);
  g_die_in_checkpoint = step;
}

void MaybeDieInCheckpoint(int step) {
  {
    absl::MutexLock lock(&g_mu);
    if (step != g_die_in_checkpoint) return;
  }
  log::Warn("--test-die-in-checkpoint {}: killing this worker in the middle of its checkpoint", step);
  std::fflush(stderr);
  raise(SIGKILL);
}

void SetStallOnJobName(const std::string& name) {
  absl::MutexLock lock(&g_mu);
  g_stall_on_job_name = name;
}

void MaybeStallLoop(const std::string& job_id, const std::string& job_name) {
  {
    absl::MutexLock lock(&g_mu);
    if (g_stall_on_job_name.empty() || job_name != g_stall_on_job_name) return;
  }
  log::Warn("job={} --test-stall-on-job-name {}: the loop stops turning, holding its lock", job_id, job_name);
  absl::SleepFor(absl::Seconds(600));
}
#else
bool Enabled() { return false; }
void SetDieInCheckpoint(int) {}
void MaybeDieInCheckpoint(int) {}
void SetStallOnJobName(const std::string&) {}
void MaybeStallLoop(const std::string&, const std::string&) {}
#endif

}  // namespace pippy::test_hooks
