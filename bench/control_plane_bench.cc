// The coordinator as a control plane under a cluster's load, with a real
// pippy-coordinator process: W simulated workers (real WorkerHub streams, registering,
// heartbeating at the daemons' 1 s interval) and J queued jobs of U users (one real
// submission of the zoo's MLP, its record, layout and files replicated in the state
// directory before the coordinator starts again on it). The workers declare a GPU too
// small for any job, so every job stays QUEUED and each scheduling pass weighs them
// all. Printed: the time for all workers to register, GetJob and ListJobs (a page of
// 100) p50/p99 under that load beside the same calls on an idle coordinator with one
// job (the reference, same run), the coordinator's CPU while only heartbeats arrive,
// and its peak resident memory.
//
//   bazel run -c opt //bench:control_plane_bench -- [--workers 1000] [--jobs 10000]
//       [--users 50] [--seconds 20]
#include <signal.h>
#include <spawn.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using namespace pippy;

struct Args {
  int workers = 1000, jobs = 10000, users = 50;
  double seconds = 20;
  std::string coordinator = "coordinator/pippy-coordinator";
  std::string model = "examples/models/zoo/mlp.pt", data = "examples/models/zoo/mlp.data.pt";
};

std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A real pippy-coordinator on 127.0.0.1 (port 0) with `state`; its pid and address.
struct Daemon {
  pid_t pid = 0;
  std::string addr;
};

Daemon StartCoordinator(const Args& a, const std::string& state) {
  const std::string port_file = state + ".port";
  fs::remove(port_file);
  std::vector<std::string> args = {a.coordinator, "--bind", "127.0.0.1", "--port", "0", "--port-file", port_file,
                                   "--state-dir", state, "--log-level", "warn", "--heartbeat-timeout-s", "30"};
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  Daemon d;
  if (posix_spawn(&d.pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    std::cerr << "cannot start " << a.coordinator << "\n";
    std::exit(1);
  }
  for (int i = 0; i < 1200 && !fs::exists(port_file); ++i) absl::SleepFor(absl::Milliseconds(50));
  if (!fs::exists(port_file)) {
    std::cerr << "the coordinator wrote no port file within 60 s\n";
    std::exit(1);
  }
  d.addr = absl::StrCat("127.0.0.1:", Slurp(port_file).substr(0, Slurp(port_file).find('\n')));
  return d;
}

void Stop(const Daemon& d) {
  kill(d.pid, SIGTERM);
  int status = 0;
  waitpid(d.pid, &status, 0);
}

// The coordinator's user+system CPU seconds and peak resident memory (kB).
double CpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string s((std::istreambuf_iterator<char>(f)), {});
  std::istringstream in(s.substr(s.rfind(')') + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int64_t PeakKb(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  }
  return 0;
}

std::unique_ptr<Coordinator::Stub> Stub(const std::string& addr) {
  return Coordinator::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
}

void Submit(const std::string& addr, const Args& a) {
  auto stub = Stub(addr);
  grpc::ClientContext ctx;
  SubmitJobResponse resp;
  auto w = stub->SubmitJob(&ctx, &resp);
  SubmitJobRequest r;
  JobSpec* spec = r.mutable_spec();
  spec->set_name("tiny");
  spec->mutable_split()->set_stages(2);
  spec->mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec->mutable_schedule()->set_microbatches(2);
  spec->set_loss(LOSS_MSE);
  spec->mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  spec->mutable_optimizer()->set_lr(0.1);
  spec->set_steps(2);
  spec->set_batch_size(8);
  w->Write(r);
  SubmitJobRequest m;
  m.set_model_chunk(Slurp(a.model));
  w->Write(m);
  SubmitJobRequest d;
  d.set_data_chunk(Slurp(a.data));
  w->Write(d);
  w->WritesDone();
  grpc::Status s = w->Finish();
  if (!s.ok()) {
    std::cerr << "submitting the seed job: " << s.error_message() << "\n";
    std::exit(1);
  }
}

// job-1's record, layout and files copied as job-2 .. job-J, users user-0 .. user-U-1,
// in one transaction (the files hard-linked).
void Replicate(const std::string& state, const Args& a) {
  sqlite3* db = nullptr;
  sqlite3_open((state + "/jobs.db").c_str(), &db);
  auto one_blob = [db](const char* sql) {
    sqlite3_stmt* st = nullptr;
    sqlite3_prepare_v2(db, sql, -1, &st, nullptr);
    std::string out;
    if (sqlite3_step(st) == SQLITE_ROW) {
      out.assign(static_cast<const char*>(sqlite3_column_blob(st, 0)), static_cast<size_t>(sqlite3_column_bytes(st, 0)));
    }
    sqlite3_finalize(st);
    return out;
  };
  Job seed;
  seed.ParseFromString(one_blob("SELECT record FROM jobs WHERE id = 'job-1'"));
  const std::string layout = one_blob("SELECT layout FROM layouts WHERE id = 'job-1'");
  if (seed.job_id() != "job-1" || layout.empty()) {
    std::cerr << "the seed job's record or layout is missing\n";
    std::exit(1);
  }
  sqlite3_exec(db, "BEGIN", nullptr, nullptr, nullptr);
  sqlite3_stmt* job_st = nullptr;
  sqlite3_stmt* layout_st = nullptr;
  sqlite3_prepare_v2(db, "INSERT OR REPLACE INTO jobs (id, created, record) VALUES (?, ?, ?)", -1, &job_st, nullptr);
  sqlite3_prepare_v2(db, "INSERT OR REPLACE INTO layouts (id, layout) VALUES (?, ?)", -1, &layout_st, nullptr);
  const fs::path seed_dir = fs::path(state) / "jobs" / "job-1";
  for (int i = 1; i <= a.jobs; ++i) {
    Job j = seed;
    const std::string id = absl::StrCat("job-", i);
    j.set_job_id(id);
    j.set_user(absl::StrCat("user-", i % a.users));
    j.set_created_unix_ms(seed.created_unix_ms() + i);
    const std::string blob = j.SerializeAsString();
    sqlite3_bind_text(job_st, 1, id.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(job_st, 2, j.created_unix_ms());
    sqlite3_bind_blob(job_st, 3, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
    sqlite3_step(job_st);
    sqlite3_reset(job_st);
    sqlite3_bind_text(layout_st, 1, id.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_blob(layout_st, 2, layout.data(), static_cast<int>(layout.size()), SQLITE_TRANSIENT);
    sqlite3_step(layout_st);
    sqlite3_reset(layout_st);
    if (i == 1) continue;
    const fs::path dir = fs::path(state) / "jobs" / id;
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(seed_dir)) {
      if (e.is_regular_file()) fs::create_hard_link(e.path(), dir / e.path().filename());
    }
  }
  sqlite3_finalize(job_st);
  sqlite3_finalize(layout_st);
  sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr);
  sqlite3_close(db);
}

struct Latencies {
  std::vector<double> ms;
  std::string Text() {
    if (ms.empty()) return "-";
    std::sort(ms.begin(), ms.end());
    auto at = [this](double q) { return ms[std::min(ms.size() - 1, static_cast<size_t>(q * static_cast<double>(ms.size())))]; };
    return absl::StrFormat("p50 %.2f ms, p99 %.2f ms (%d calls)", at(0.5), at(0.99), static_cast<int>(ms.size()));
  }
  double P99() {
    std::sort(ms.begin(), ms.end());
    return ms.empty() ? 0 : ms[std::min(ms.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(ms.size())))];
  }
};

// GetJob of random jobs and ListJobs pages of 100 (walking the pages, some filtered by
// user), from `threads` client threads for `seconds`.
void Query(const std::string& addr, int jobs, int users, double seconds, int threads, Latencies* get,
           Latencies* list) {
  std::vector<Latencies> gets(static_cast<size_t>(threads)), lists(static_cast<size_t>(threads));
  std::vector<std::thread> ts;
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      auto stub = Stub(addr);
      std::mt19937 rng(static_cast<unsigned>(t));
      std::string token;
      for (int i = 0; absl::Now() < end; ++i) {
        grpc::ClientContext ctx;
        const auto start = absl::Now();
        if (i % 4 != 3) {
          GetJobRequest r;
          r.set_job_id(absl::StrCat("job-", 1 + rng() % static_cast<unsigned>(jobs)));
          Job j;
          if (stub->GetJob(&ctx, r, &j).ok()) gets[t].ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        } else {
          ListJobsRequest r;
          r.set_page_size(100);
          r.set_page_token(token);
          if (t % 2 == 1) r.set_user(absl::StrCat("user-", t % users));
          ListJobsResponse resp;
          if (stub->ListJobs(&ctx, r, &resp).ok()) {
            lists[t].ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
            token = resp.next_page_token();
          }
        }
      }
    });
  }
  for (auto& th : ts) th.join();
  for (auto& l : gets) get->ms.insert(get->ms.end(), l.ms.begin(), l.ms.end());
  for (auto& l : lists) list->ms.insert(list->ms.end(), l.ms.begin(), l.ms.end());
}

// W worker streams over a few connections; each registers, then heartbeats every 1 s.
class SimulatedWorkers {
 public:
  SimulatedWorkers(const std::string& addr, int n) : n_(n), registered_at_(static_cast<size_t>(n), absl::InfinitePast()) {
    const int per_channel = 40;
    for (int c = 0; c * per_channel < n; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection of its own
      args.SetInt("pippy.bench.channel", c);
      channels_.push_back(grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args));
    }
    start_ = absl::Now();
    for (int i = 0; i < n; ++i) {
      auto w = std::make_unique<Stream>();
      w->stub = WorkerHub::NewStub(channels_[static_cast<size_t>(i / per_channel)]);
      w->rw = w->stub->Connect(&w->ctx);
      WorkerMessage reg;
      reg.mutable_register_()->set_name(absl::StrCat("sim-", i));
      reg.mutable_register_()->set_host("sim");
      reg.mutable_register_()->set_device("cuda:0");
      reg.mutable_register_()->set_device_name("simulated");
      reg.mutable_register_()->set_free_memory(1);  // fits no job: every job stays QUEUED
      w->rw->Write(reg);
      Stream* s = w.get();
      s->reader = std::thread([this, s, i] {
        CoordinatorMessage m;
        while (s->rw->Read(&m)) {
          if (m.has_registered() && registered_at_[static_cast<size_t>(i)] == absl::InfinitePast()) {
            registered_at_[static_cast<size_t>(i)] = absl::Now();
            ++registered_;
          }
        }
      });
      streams_.push_back(std::move(w));
    }
    heartbeat_ = std::thread([this] {
      while (!stop_) {
        const absl::Time round = absl::Now();
        for (auto& s : streams_) {
          WorkerMessage hb;
          hb.mutable_heartbeat()->set_unix_ms(absl::ToUnixMillis(absl::Now()));
          s->rw->Write(hb);
          if (stop_) break;
        }
        absl::SleepFor(absl::Seconds(1) - (absl::Now() - round));
      }
    });
  }
  ~SimulatedWorkers() {
    stop_ = true;
    heartbeat_.join();
    for (auto& s : streams_) s->ctx.TryCancel();
    for (auto& s : streams_) s->reader.join();
  }
  // Seconds until all registered (waits up to 120 s); -1 if they did not.
  double AllRegistered() {
    for (int i = 0; i < 2400 && registered_ < n_; ++i) absl::SleepFor(absl::Milliseconds(50));
    if (registered_ < n_) return -1;
    absl::Time last = start_;
    for (absl::Time t : registered_at_) last = std::max(last, t);
    return absl::ToDoubleSeconds(last - start_);
  }

 private:
  struct Stream {
    std::unique_ptr<WorkerHub::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<WorkerMessage, CoordinatorMessage>> rw;
    std::thread reader;
  };
  const int n_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<absl::Time> registered_at_;
  std::atomic<int> registered_{0};
  std::atomic<bool> stop_{false};
  absl::Time start_;
  std::thread heartbeat_;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--workers") a.workers = std::stoi(v);
    else if (k == "--jobs") a.jobs = std::stoi(v);
    else if (k == "--users") a.users = std::stoi(v);
    else if (k == "--seconds") a.seconds = std::stod(v);
    else if (k == "--coordinator") a.coordinator = v;
    else {
      std::cerr << "unknown flag " << k << "\n";
      return 2;
    }
  }
  const std::string state = (fs::temp_directory_path() / absl::StrCat("pippy-control-plane-", getpid())).string();
  fs::remove_all(state);
  // The reference: an idle coordinator with one job.
  Daemon d = StartCoordinator(a, state);
  Submit(d.addr, a);
  Latencies get0, list0;
  Query(d.addr, 1, 1, std::min(5.0, a.seconds), 2, &get0, &list0);
  Stop(d);
  Replicate(state, a);
  const absl::Time restart = absl::Now();
  d = StartCoordinator(a, state);
  const double restart_s = absl::ToDoubleSeconds(absl::Now() - restart);
  double registered_s = -1, cores = 0;
  Latencies get, list;
  {
    SimulatedWorkers workers(d.addr, a.workers);
    registered_s = workers.AllRegistered();
    // Only heartbeats for a while: the coordinator's CPU for them (and its scheduling passes).
    const double cpu0 = CpuSeconds(d.pid);
    const absl::Time t0 = absl::Now();
    absl::SleepFor(absl::Seconds(std::min(10.0, a.seconds)));
    cores = (CpuSeconds(d.pid) - cpu0) / absl::ToDoubleSeconds(absl::Now() - t0);
    Query(d.addr, a.jobs, a.users, a.seconds, 4, &get, &list);
  }
  const int64_t peak_kb = PeakKb(d.pid);
  Stop(d);
  fs::remove_all(state);
  std::cout << absl::StrFormat(
      "control plane: %d simulated workers (1 s heartbeats), %d queued jobs of %d users, a real pippy-coordinator\n",
      a.workers, a.jobs, a.users);
  std::cout << absl::StrFormat("  %-34s %s\n", "restart onto the job records", absl::StrFormat("%.2f s", restart_s));
  std::cout << absl::StrFormat("  %-34s %s\n", "all workers registered in",
                               registered_s < 0 ? std::string("NOT ALL within 120 s") : absl::StrFormat("%.2f s", registered_s));
  std::cout << absl::StrFormat("  %-34s %.3f cores (target < 1)\n", "CPU, heartbeats only", cores);
  std::cout << absl::StrFormat("  %-34s %s   idle, 1 job: %s   p99 ratio %.1fx (target p99 < 10 ms)\n",
                               "GetJob under load", get.Text(), get0.Text(), get.P99() / std::max(1e-9, get0.P99()));
  std::cout << absl::StrFormat("  %-34s %s   idle, 1 job: %s   p99 ratio %.1fx (target p99 < 50 ms)\n",
                               "ListJobs (page of 100) under load", list.Text(), list0.Text(),
                               list.P99() / std::max(1e-9, list0.P99()));
  std::cout << absl::StrFormat("  %-34s %d MiB (target < 1024)\n", "coordinator peak resident", peak_kb / 1024);
  return 0;
}
