// Job records in SQLite under the coordinator's state directory, so ListJobs survives
// a restart. Files (models, stages, results) are the ArtifactStore's.
//
// Thread safety: all methods may be called from any thread (one internal mutex).
#ifndef PIPPY_COORDINATOR_JOB_STORE_H_
#define PIPPY_COORDINATOR_JOB_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/coordinator.pb.h"

struct sqlite3;

namespace pippy::coordinator {

class JobStore {
 public:
  // Opens (creating) `dir`/jobs.db. Errors: UNAVAILABLE naming the path.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& dir);
  ~JobStore();

  // Errors: UNAVAILABLE with SQLite's message.
  absl::Status Put(const Job& job);
  // Every record, oldest first; records that do not parse are skipped (logged).
  std::vector<Job> List();

  // A counter kept across restarts (the next worker id). Errors: UNAVAILABLE.
  absl::Status PutCounter(const std::string& name, int64_t value);
  int64_t GetCounter(const std::string& name, int64_t missing);

 private:
  JobStore() = default;
  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_STORE_H_
