#include "client/remote_commands.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/args.h"
#include "client/exit_codes.h"
#include "client/table.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "pipeline/partition/model_io.h"
#include "proto/coordinator.grpc.pb.h"

extern char** environ;

namespace pippy::cli {
namespace {

constexpr char kSubmitHelp[] = R"(usage: pippyctl submit MODEL.pt (--data FILE | --synthetic SPEC) (--stages K | --split-at A,B) --schedule NAME
                        --microbatches M --batch-size B --steps N --loss L --optimizer O --lr X
                        [--balance params|flops|time] [--stages-per-worker V] [--momentum X]
                        [--weight-decay X] [--clip-grad-norm X] [--name N] [--wait] [--output table|json]

  --data FILE          torch.save({"inputs": ..., "targets": ...}); step k trains on samples
                       [k*B, (k+1)*B) of it, wrapping around
  --synthetic SPEC     or data made by the coordinator, for benchmarks:
                       "inputs=float32[256,1024];targets=float32[256,1024];seed=0"
                       (int64[64,16]@64 for integers in [0, 64))
  --schedule NAME      gpipe | 1f1b | interleaved-1f1b | looped-bfs | zb1p | zbv | inference
  --loss L             mse | cross_entropy | model (the model's loss(self, output, target))
  --optimizer O        sgd | adam | adamw
  --wait               watch until the job ends; exit 0 only if it SUCCEEDED
Prints the job id (--output json: {"job_id": ...}).
)";

absl::Status FromGrpc(const grpc::Status& s, const std::string& coordinator) {
  if (s.ok()) return absl::OkStatus();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", coordinator, " (", s.error_message(),
                                               "); start one (pippyctl local) or set --coordinator / PIPPY_COORDINATOR"));
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string StateName(JobState s) { return JobState_Name(s); }

bool Terminal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

void PrintJob(const Job& j) {
  std::cout << "job " << j.job_id() << ": " << StateName(j.state());
  if (!j.reason().empty()) std::cout << " — " << j.reason();
  std::cout << "\n  schedule " << j.spec().schedule().name() << ", " << j.plan().stages_size() << " stages on "
            << j.workers_size() << " workers, step " << j.step() << "/" << j.spec().steps();
  if (j.losses_size() > 0) std::cout << ", loss " << j.losses(j.losses_size() - 1);
  std::cout << "\n";
  if (j.losses_size() > 0) {
    std::cout << "  losses:";
    for (double l : j.losses()) std::cout << " " << absl::StrFormat("%.4f", l);
    std::cout << "\n";
  }
}

// Follows a job until it ends; returns its final state.
absl::StatusOr<Job> Watch(Coordinator::Stub* stub, const std::string& job_id, bool json, const std::string& where) {
  grpc::ClientContext ctx;
  WatchJobRequest req;
  req.set_job_id(job_id);
  auto reader = stub->WatchJob(&ctx, req);
  ProgressEvent e;
  const bool tty = isatty(1) && !json;
  while (reader->Read(&e)) {
    if (json) {
      std::cout << Json(e) << std::endl;
    } else {
      int width = 30, done = e.steps() > 0 ? width * e.step() / e.steps() : 0;
      std::string bar = std::string(done, '#') + std::string(width - done, '.');
      std::string line = absl::StrFormat("[%s] %s step %d/%d", bar, StateName(e.state()), e.step(), e.steps());
      if (e.step() > 0) {
        absl::StrAppend(&line, absl::StrFormat("  loss %.4f  %.0f samples/s  bubble %.0f%%", e.loss(),
                                               e.samples_per_second(), 100 * e.bubble_fraction()));
      }
      std::cout << (tty ? "\r" : "") << line << (tty ? "   " : "\n") << std::flush;
    }
    if (Terminal(e.state())) break;
  }
  if (tty) std::cout << "\n";
  grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpc(s, where);
  grpc::ClientContext ctx2;
  GetJobRequest g;
  g.set_job_id(job_id);
  Job job;
  s = stub->GetJob(&ctx2, g, &job);
  if (!s.ok()) return FromGrpc(s, where);
  return job;
}

int Submit(Coordinator::Stub* stub, const std::string& where, int argc, char** argv, int first) {
  auto args = Args::Parse(argc, argv, first,
                          {{"data"}, {"synthetic"}, {"stages"}, {"split-at"}, {"balance"}, {"schedule"},
                           {"microbatches"}, {"batch-size"}, {"steps"}, {"loss"}, {"optimizer"}, {"lr"},
                           {"momentum"}, {"weight-decay"}, {"clip-grad-norm"}, {"stages-per-worker"}, {"name"},
                           {"seed"}, {"wait", false}, {"output"}});
  if (!args.ok()) return Fail(args.status());
  if (args->Has("help")) {
    std::cout << kSubmitHelp;
    return kExitOk;
  }
  if (args->positional().size() != 1) return Fail(absl::InvalidArgumentError("submit takes one MODEL.pt (see --help)"));
  auto model = partition::ReadFile(args->positional()[0]);
  if (!model.ok()) return Fail(model.status());
  std::string data;
  if (args->Has("data")) {
    auto d = partition::ReadFile(args->Get("data"));
    if (!d.ok()) return Fail(d.status());
    data = *d;
  }
  JobSpec spec;
  spec.set_name(args->Get("name", std::filesystem::path(args->positional()[0]).stem().string()));
  auto stages = args->GetInt("stages", 0), mbs = args->GetInt("microbatches", 0), bs = args->GetInt("batch-size", 0),
       steps = args->GetInt("steps", 1), v = args->GetInt("stages-per-worker", 0);
  auto lr = args->GetDouble("lr", 0.01), mom = args->GetDouble("momentum", 0), wd = args->GetDouble("weight-decay", 0),
       clip = args->GetDouble("clip-grad-norm", 0);
  for (const absl::Status& s : {stages.status(), mbs.status(), bs.status(), steps.status(), v.status(), lr.status(),
                                mom.status(), wd.status(), clip.status()}) {
    if (!s.ok()) return Fail(s);
  }
  spec.mutable_split()->set_stages(*stages);
  for (const std::string& p : SplitList(args->Get("split-at"))) spec.mutable_split()->add_split_at(p);
  spec.mutable_split()->set_balance(args->Get("balance"));
  spec.mutable_schedule()->set_name(args->Get("schedule"));
  spec.mutable_schedule()->set_microbatches(*mbs);
  spec.mutable_schedule()->set_stages_per_worker(*v);
  spec.set_mode(args->Get("schedule") == "inference" ? "inference" : "train");
  spec.set_loss(args->Get("loss"));
  spec.mutable_optimizer()->set_name(args->Get("optimizer"));
  spec.mutable_optimizer()->set_lr(*lr);
  spec.mutable_optimizer()->set_momentum(*mom);
  spec.mutable_optimizer()->set_weight_decay(*wd);
  spec.mutable_optimizer()->set_clip_grad_norm(*clip);
  spec.set_steps(*steps);
  spec.set_batch_size(*bs);
  spec.mutable_data()->set_file(args->Get("data"));
  spec.mutable_data()->set_synthetic(args->Get("synthetic"));
  grpc::ClientContext ctx;
  SubmitJobResponse resp;
  auto writer = stub->SubmitJob(&ctx, &resp);
  SubmitJobRequest req;
  *req.mutable_spec() = spec;
  writer->Write(req);
  constexpr size_t kChunk = 1 << 20;
  for (size_t off = 0; off < model->size(); off += kChunk) {
    SubmitJobRequest c;
    c.set_model_chunk(model->substr(off, kChunk));
    if (!writer->Write(c)) break;
  }
  for (size_t off = 0; off < data.size(); off += kChunk) {
    SubmitJobRequest c;
    c.set_data_chunk(data.substr(off, kChunk));
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return Fail(FromGrpc(s, where));
  const bool json = args->Get("output", "table") == "json";
  if (json) std::cout << "{\"job_id\": \"" << resp.job_id() << "\"}" << std::endl;
  else std::cout << resp.job_id() << std::endl;
  if (!args->Has("wait")) return kExitOk;
  auto job = Watch(stub, resp.job_id(), json, where);
  if (!job.ok()) return Fail(job.status());
  if (!json) PrintJob(*job);
  if (job->state() != SUCCEEDED) {
    std::cerr << "pippyctl: job " << job->job_id() << " " << StateName(job->state()) << ": " << job->reason() << "\n";
    return kExitInternal;
  }
  return kExitOk;
}

}  // namespace

int RunRemoteCommand(const std::string& command, const std::string& where, int argc, char** argv, int first) {
  if (command == "submit" && first < argc && (std::string(argv[first]) == "--help" || std::string(argv[first]) == "-h")) {
    std::cout << kSubmitHelp;
    return kExitOk;
  }
  auto channel = grpc::CreateChannel(where, grpc::InsecureChannelCredentials());
  auto stub = Coordinator::NewStub(channel);
  if (command == "submit") return Submit(stub.get(), where, argc, argv, first);
  auto args = Args::Parse(argc, argv, first, {{"output"}, {"o"}});
  if (!args.ok()) return Fail(args.status());
  const bool json = args->Get("output", "table") == "json";
  auto need_job = [&]() -> absl::StatusOr<std::string> {
    if (args->positional().size() != 1) return absl::InvalidArgumentError(absl::StrCat(command, " takes one JOB id"));
    return args->positional()[0];
  };
  if (command == "list") {
    grpc::ClientContext ctx;
    ListJobsResponse r;
    grpc::Status s = stub->ListJobs(&ctx, ListJobsRequest(), &r);
    if (!s.ok()) return Fail(FromGrpc(s, where));
    if (json) {
      std::cout << Json(r) << "\n";
      return kExitOk;
    }
    Table t({"job", "name", "state", "schedule", "stages", "step", "loss", "reason"});
    for (const Job& j : r.jobs()) {
      t.AddRow({j.job_id(), j.spec().name(), StateName(j.state()), j.spec().schedule().name(),
                absl::StrCat(j.plan().stages_size()), absl::StrCat(j.step(), "/", j.spec().steps()),
                j.losses_size() ? absl::StrFormat("%.4f", j.losses(j.losses_size() - 1)) : "-", j.reason()});
    }
    std::cout << t.Render();
    return kExitOk;
  }
  if (command == "workers") {
    grpc::ClientContext ctx;
    ListWorkersResponse r;
    grpc::Status s = stub->ListWorkers(&ctx, ListWorkersRequest(), &r);
    if (!s.ok()) return Fail(FromGrpc(s, where));
    if (json) {
      std::cout << Json(r) << "\n";
      return kExitOk;
    }
    Table t({"worker", "name", "host", "device", "state", "job", "rank"});
    for (const WorkerInfo& w : r.workers()) {
      t.AddRow({w.worker_id(), w.name(), w.host(), w.device(), w.state(), w.job_id().empty() ? "-" : w.job_id(),
                w.job_id().empty() ? "-" : absl::StrCat(w.rank())});
    }
    std::cout << t.Render();
    return kExitOk;
  }
  auto job_id = need_job();
  if (!job_id.ok()) return Fail(job_id.status());
  if (command == "status" || command == "cancel") {
    grpc::ClientContext ctx;
    Job j;
    grpc::Status s;
    if (command == "status") {
      GetJobRequest r;
      r.set_job_id(*job_id);
      s = stub->GetJob(&ctx, r, &j);
    } else {
      CancelJobRequest r;
      r.set_job_id(*job_id);
      s = stub->CancelJob(&ctx, r, &j);
    }
    if (!s.ok()) return Fail(FromGrpc(s, where));
    if (json) std::cout << Json(j) << "\n";
    else PrintJob(j);
    return kExitOk;
  }
  if (command == "watch") {
    auto j = Watch(stub.get(), *job_id, json, where);
    if (!j.ok()) return Fail(j.status());
    if (!json) PrintJob(*j);
    return j->state() == SUCCEEDED ? kExitOk : kExitInternal;
  }
  if (command == "fetch") {
    const std::string out = args->Get("o", args->Get("output-file"));
    if (out.empty()) return Fail(absl::InvalidArgumentError("fetch needs -o OUT.pt"));
    grpc::ClientContext ctx;
    FetchModelRequest r;
    r.set_job_id(*job_id);
    auto reader = stub->FetchModel(&ctx, r);
    std::string bytes;
    ModelChunk c;
    while (reader->Read(&c)) bytes += c.data();
    grpc::Status s = reader->Finish();
    if (!s.ok()) return Fail(FromGrpc(s, where));
    std::ofstream(out, std::ios::binary) << bytes;
    std::cout << "wrote the trained model of " << *job_id << " to " << out << " (" << HumanBytes(bytes.size()) << ")\n";
    return kExitOk;
  }
  return Fail(absl::InvalidArgumentError(absl::StrCat("unknown command '", command, "'; run pippyctl --help")));
}

namespace {

volatile sig_atomic_t g_stop = 0;

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

std::string FindBinary(const std::string& self, const std::string& name, const std::string& bazel_dir) {
  std::filesystem::path dir = std::filesystem::path(self).parent_path();
  for (const auto& p : {dir / name, dir / ".." / bazel_dir / name}) {
    if (std::filesystem::exists(p)) return p.string();
  }
  return name;  // on PATH
}

}  // namespace

int RunLocalCommand(int argc, char** argv, int first, const std::string& self) {
  auto args = Args::Parse(argc, argv, first, {{"workers"}, {"port"}, {"state-dir"}, {"threads"}, {"ucx-tls"}});
  if (!args.ok()) return Fail(args.status());
  if (args->Has("help")) {
    std::cout << "usage: pippyctl local --workers N [--port P] [--state-dir DIR] [--threads T]\n"
                 "Runs a coordinator on 127.0.0.1:P (default 7070) and N workers in the foreground;\n"
                 "Ctrl-C stops them all.\n";
    return kExitOk;
  }
  auto n = args->GetInt("workers", 1), port = args->GetInt("port", 7070), threads = args->GetInt("threads", 1);
  if (!n.ok()) return Fail(n.status());
  if (!port.ok()) return Fail(port.status());
  if (!threads.ok()) return Fail(threads.status());
  const std::string coord = FindBinary(self, "pippy-coordinator", "coordinator");
  const std::string worker = FindBinary(self, "pippy-worker", "worker");
  const std::string state = args->Get("state-dir", "pippy-state");
  std::vector<pid_t> pids;
  pids.push_back(Spawn({coord, "--bind", "127.0.0.1", "--port", std::to_string(*port), "--state-dir", state}));
  if (pids.back() < 0) return Fail(absl::NotFoundError(absl::StrCat("cannot start ", coord)));
  const std::string where = absl::StrCat("127.0.0.1:", *port);
  for (int i = 0; i < *n; ++i) {
    std::vector<std::string> a = {worker, "--coordinator", where, "--name", absl::StrCat("local-", i), "--threads",
                                  std::to_string(*threads)};
    if (args->Has("ucx-tls")) {
      a.push_back("--ucx-tls");
      a.push_back(args->Get("ucx-tls"));
    }
    pids.push_back(Spawn(a));
  }
  std::cerr << "pippyctl local: coordinator on " << where << " with " << *n << " workers (Ctrl-C stops them)\n";
  signal(SIGINT, [](int) { g_stop = 1; });
  signal(SIGTERM, [](int) { g_stop = 1; });
  int code = kExitOk;
  while (!g_stop) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      std::cerr << "pippyctl local: process " << done << " exited; stopping the others\n";
      for (pid_t& p : pids) if (p == done) p = -1;
      code = kExitInternal;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (pid_t p : pids) if (p > 0) kill(p, SIGTERM);
  for (pid_t p : pids) {
    if (p <= 0) continue;
    for (int i = 0; i < 50 && waitpid(p, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  return code;
}

}  // namespace pippy::cli
