// Job records and layouts in SQLite under the coordinator's state directory, so
// ListJobs survives a restart and a restarted coordinator resumes a job on the layout
// it was prepared with. Files (models, stages, results) are the ArtifactStore's.
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
#include "proto/plan.pb.h"

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

  // Forgets a job: its record and its layout. Errors: UNAVAILABLE.
  absl::Status Delete(const std::string& job_id);

  // A job's layout (pipeline/job/layout.h), saved once when the job is accepted.
  // Errors: UNAVAILABLE with SQLite's message.
  absl::Status PutLayout(const std::string& job_id, const JobLayout& layout);
  // Errors: NOT_FOUND when none was saved (a record of an older version); DATA_LOSS when
  // it does not parse.
  absl::StatusOr<JobLayout> GetLayout(const std::string& job_id);

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
