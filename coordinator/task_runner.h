// Threads for the coordinator's work that must not run under its lock: streaming
// stage files to workers, assembling a trained model. Each task gets its own thread;
// finished threads are joined on the next Run, the rest at destruction.
//
// Thread safety: Run may be called from any thread, also from a task.
#ifndef PIPPY_COORDINATOR_TASK_RUNNER_H_
#define PIPPY_COORDINATOR_TASK_RUNNER_H_

#include <functional>
#include <list>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pippy::coordinator {

class TaskRunner {
 public:
  TaskRunner() = default;
  TaskRunner(const TaskRunner&) = delete;
  TaskRunner& operator=(const TaskRunner&) = delete;
  // Waits for every task. Tasks must end by themselves (they watch their own stop flags).
  ~TaskRunner();

  void Run(std::function<void()> task);

 private:
  struct Entry {
    std::thread thread;
    bool done = false;
  };
  absl::Mutex mu_;
  std::list<Entry> tasks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_TASK_RUNNER_H_
