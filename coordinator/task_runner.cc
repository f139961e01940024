#include "coordinator/task_runner.h"

namespace pippy::coordinator {

TaskRunner::~TaskRunner() {
  std::list<Entry> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(tasks_);
  }
  for (Entry& e : all) {
    if (e.thread.joinable()) e.thread.join();
  }
}

void TaskRunner::Run(std::function<void()> task) {
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = tasks_.begin(); it != tasks_.end();) {
      if (it->done) {
        finished.push_back(std::move(it->thread));
        it = tasks_.erase(it);
      } else {
        ++it;
      }
    }
    tasks_.emplace_back();
    Entry* entry = &tasks_.back();  // a list element stays put until erased, and only done ones are
    entry->thread = std::thread([this, entry, task = std::move(task)] {
      task();
      absl::MutexLock lock(&mu_);
      entry->done = true;
    });
  }
  // These have set `done` as their last act: joining them does not wait for work.
  for (std::thread& t : finished) t.join();
}

}  // namespace pippy::coordinator
