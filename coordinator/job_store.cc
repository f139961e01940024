#include "coordinator/job_store.h"

#include <sqlite3.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pippy::coordinator {

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create state directory '", dir, "': ", ec.message()));
  std::unique_ptr<JobStore> store(new JobStore());
  const std::string path = dir + "/jobs.db";
  absl::MutexLock lock(&store->mu_);
  if (sqlite3_open(path.c_str(), &store->db_) != SQLITE_OK) {
    return absl::UnavailableError(absl::StrCat("cannot open '", path, "': ", sqlite3_errmsg(store->db_)));
  }
  char* err = nullptr;
  if (sqlite3_exec(store->db_,
                   "PRAGMA journal_mode=WAL; CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, created INTEGER, "
                   "record BLOB); CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER); "
                   "CREATE TABLE IF NOT EXISTS layouts (id TEXT PRIMARY KEY, layout BLOB);",
                   nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown";
    sqlite3_free(err);
    return absl::UnavailableError(absl::StrCat("cannot initialise '", path, "': ", msg));
  }
  return store;
}

JobStore::~JobStore() {
  absl::MutexLock lock(&mu_);
  if (db_ != nullptr) sqlite3_close(db_);
}

absl::Status JobStore::Put(const Job& job) {
  std::string blob;
  job.SerializeToString(&blob);
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO jobs (id, created, record) VALUES (?, ?, ?)", -1, &st, nullptr);
  sqlite3_bind_text(st, 1, job.job_id().c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 2, job.created_unix_ms());
  sqlite3_bind_blob(st, 3, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return absl::UnavailableError(absl::StrCat("saving job ", job.job_id(), ": ", sqlite3_errmsg(db_)));
  return absl::OkStatus();
}

absl::Status JobStore::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (const char* sql : {"DELETE FROM jobs WHERE id = ?", "DELETE FROM layouts WHERE id = ?"}) {
    sqlite3_stmt* st = nullptr;
    sqlite3_prepare_v2(db_, sql, -1, &st, nullptr);
    sqlite3_bind_text(st, 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
    const int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return absl::UnavailableError(absl::StrCat("deleting job ", job_id, ": ", sqlite3_errmsg(db_)));
  }
  return absl::OkStatus();
}

std::vector<Job> JobStore::List() {
  std::vector<Job> out;
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "SELECT record FROM jobs ORDER BY created, id", -1, &st, nullptr);
  while (sqlite3_step(st) == SQLITE_ROW) {
    Job job;
    const void* data = sqlite3_column_blob(st, 0);
    int n = sqlite3_column_bytes(st, 0);
    if (job.ParseFromArray(data, n)) {
      out.push_back(job);
    } else {
      log::Warn("a job record in jobs.db does not parse (written by another version?); skipped");
    }
  }
  sqlite3_finalize(st);
  return out;
}

absl::Status JobStore::PutLayout(const std::string& job_id, const JobLayout& layout) {
  std::string blob;
  layout.SerializeToString(&blob);
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO layouts (id, layout) VALUES (?, ?)", -1, &st, nullptr);
  sqlite3_bind_text(st, 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(st, 2, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return absl::UnavailableError(absl::StrCat("saving job ", job_id, "'s layout: ", sqlite3_errmsg(db_)));
  return absl::OkStatus();
}

absl::StatusOr<JobLayout> JobStore::GetLayout(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "SELECT layout FROM layouts WHERE id = ?", -1, &st, nullptr);
  sqlite3_bind_text(st, 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
  absl::StatusOr<JobLayout> out = absl::NotFoundError(absl::StrCat("no layout of job ", job_id, " in jobs.db"));
  if (sqlite3_step(st) == SQLITE_ROW) {
    JobLayout layout;
    if (layout.ParseFromArray(sqlite3_column_blob(st, 0), sqlite3_column_bytes(st, 0))) {
      out = std::move(layout);
    } else {
      out = absl::DataLossError(absl::StrCat("job ", job_id, "'s layout in jobs.db does not parse"));
    }
  }
  sqlite3_finalize(st);
  return out;
}

absl::Status JobStore::PutCounter(const std::string& name, int64_t value) {
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)", -1, &st, nullptr);
  sqlite3_bind_text(st, 1, name.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 2, value);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return absl::UnavailableError(absl::StrCat("saving counter ", name, ": ", sqlite3_errmsg(db_)));
  return absl::OkStatus();
}

int64_t JobStore::GetCounter(const std::string& name, int64_t missing) {
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db_, "SELECT value FROM counters WHERE name = ?", -1, &st, nullptr);
  sqlite3_bind_text(st, 1, name.c_str(), -1, SQLITE_TRANSIENT);
  int64_t value = missing;
  if (sqlite3_step(st) == SQLITE_ROW) value = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  return value;
}

}  // namespace pippy::coordinator
