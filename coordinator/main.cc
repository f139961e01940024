// pippy-coordinator: parses flags, wires the service logic to gRPC; nothing else.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/port_owner.h"
#include "common/test_hooks.h"
#include "common/metrics.h"
#include "common/systemd.h"
#include "common/tls.h"
#include "coordinator/grpc_service.h"
#include "coordinator/job_preparation.h"
#include "coordinator/result_assembly.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"

namespace {

constexpr char kProgram[] = "pippy-coordinator";
std::unique_ptr<grpc::Server> g_server;
pippy::coordinator::Coordinator* g_coordinator = nullptr;
std::atomic<bool> g_stopping{false};

// Every flag, as parsed.
struct Flags {
  std::string bind, state_dir = "pippy-state", port_file, log_level = "info", auth_token_file;
  int port = 7070;
  double heartbeat_timeout_s = 10;
  int max_message_mib = 16;
  pippy::tls::ServerFiles tls_files;
  int64_t max_model_mib = 0, max_data_mib = 0, max_dataset_upload_gib = 64;
  int max_streams = 0, max_queued = 0;
  double stream_idle_timeout_s = 60;
  double prepare_timeout_s = 300, probe_timeout_s = 120;
  std::vector<std::string> dataset_roots;
  double job_retention_days = 0;
  int max_finished_jobs = 0;
  int metrics_port = -1;
  bool insecure = false;
  std::string test_stall_on_job_name;
};

void AddFlags(CLI::App& app, Flags* f) {
  using namespace pippy;
  app.add_option("--bind", f->bind,
                 "address to listen on (default: 0.0.0.0 when secured with --tls-cert, --tls-client-ca and "
                 "--auth-token-file; else 127.0.0.1 only; another address without them needs --insecure)");
  app.add_option("--port", f->port, "gRPC port; 0 lets the OS choose (see --port-file)")
      ->check(CLI::Range(0, 65535))->capture_default_str();
  app.add_option("--state-dir", f->state_dir,
                 "job records (SQLite), submitted models, stage files and trained models")
      ->envname("PIPPY_STATE_DIR")->capture_default_str();
  app.add_option("--heartbeat-timeout-s", f->heartbeat_timeout_s,
                 "a worker silent this long is removed and its job fails")
      ->check(cli::Positive())->capture_default_str();
  app.add_option("--port-file", f->port_file, "write the port actually bound to this file (for --port 0)");
  app.add_option("--max-message-mib", f->max_message_mib,
                 "largest gRPC message accepted; files travel in 1 MiB chunks, so models of any size fit")
      ->check(CLI::Range(2, 2047))->capture_default_str();
  app.add_option("--tls-cert", f->tls_files.cert, "serve gRPC over TLS with this certificate (PEM; with --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", f->tls_files.key, "the certificate's private key (PEM)")->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", f->tls_files.client_ca,
                 "mTLS for workers: WorkerHub accepts only clients whose certificate this CA signed (PEM)")
      ->check(CLI::ExistingFile);
  app.add_option("--max-model-mib", f->max_model_mib, "refuse submitted models larger than this (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--max-data-mib", f->max_data_mib, "refuse submitted data files larger than this (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--max-dataset-upload-gib", f->max_dataset_upload_gib,
                 "refuse datasets uploaded with a submission (pippyctl --dataset-upload) larger than this, all "
                 "shards together (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--max-concurrent-streams", f->max_streams,
                 "uploads (SubmitJob) and downloads (FetchModel) served at once; more are refused (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--stream-idle-timeout-s", f->stream_idle_timeout_s,
                 "an upload that sends nothing, or a download whose client reads nothing, this long is cancelled and "
                 "its stream slot freed (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--max-queued-jobs-per-user", f->max_queued,
                 "jobs one user may have waiting for workers at once (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--auth-token-file", f->auth_token_file,
                 "user tokens, one \"NAME TOKEN\" per line: every Coordinator call then needs \"authorization: "
                 "Bearer TOKEN\" (pippyctl --token-file / PIPPY_TOKEN), and a job can be cancelled only by its "
                 "submitter")
      ->check(CLI::ExistingFile);
  app.add_option("--prepare-timeout-s,--model-check-timeout-s", f->prepare_timeout_s,
                 "a submission is prepared (loaded, checked against its data, split, its stage files written) in a "
                 "child process, and a trained model merged in one; a child that takes longer is stopped and the "
                 "submission refused")
      ->check(cli::Positive())->capture_default_str();
  app.add_option("--probe-timeout-s", f->probe_timeout_s,
                 "the submitted model's forward on one micro-batch (shape probe, loss check, the split's stage "
                 "forwards, --balance time) must finish within this, in the preparing child")
      ->check(cli::Positive())->capture_default_str();
  app.add_option("--dataset-root", f->dataset_roots,
                 "a folder jobs' datasets (pippyctl submit --dataset) may be read from, symbolic links resolved; "
                 "repeat for several. The coordinator indexes a dataset there; the workers read it (their own "
                 "--dataset-root). Default: none, datasets are refused")
      ->check(CLI::ExistingDirectory);
  app.add_option("--job-retention-days", f->job_retention_days,
                 "delete ended jobs (record, files, trained model) this long after they ended (0: keep them)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--max-finished-jobs", f->max_finished_jobs,
                 "keep at most this many ended jobs, deleting the longest-ended first (0: no limit)")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--metrics-port", f->metrics_port,
                 "serve Prometheus metrics at http://BIND:PORT/metrics (0: any free port, printed in the log)")
      ->check(CLI::Range(0, 65535));
  app.add_flag("--insecure", f->insecure,
               "listen beyond loopback without TLS, worker mTLS or user tokens: anyone who reaches the port can "
               "register as a worker (and receive users' models and data) or submit and cancel jobs; logged as a "
               "warning, and pippyctl health says so");
  // Test builds only, hidden (no --help line): a fault for the e2e tests.
  if (test_hooks::Enabled()) app.add_option("--test-stall-on-job-name", f->test_stall_on_job_name)->group("");
  app.add_option("--log-level", f->log_level, "debug | info | warn | error")
      ->check(CLI::IsMember({"debug", "info", "warn", "error", "off"}))->capture_default_str();
}

// The stop signals' self-pipe: the handler writes the signal's number, Serve's
// signal thread reads it.
int g_signal_pipe[2] = {-1, -1};

void OnStopSignal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  (void)!write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

// Opens the pipe and installs the handler. Errors: INTERNAL.
absl::Status CatchStopSignals() {
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return absl::InternalError("cannot create the signal pipe");
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &sa, nullptr) != 0 || sigaction(SIGINT, &sa, nullptr) != 0) {
    return absl::InternalError("cannot install the SIGTERM/SIGINT handler");
  }
  return absl::OkStatus();
}

bool IsLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || absl::StartsWith(host, "127.");
}

// What is missing for the coordinator to be secured beyond loopback: TLS, mTLS for
// workers, user tokens ("" when nothing is).
std::string MissingSecurity(const Flags& f) {
  std::vector<std::string> missing;
  if (f.tls_files.cert.empty()) missing.push_back("TLS (--tls-cert, --tls-key)");
  if (f.tls_files.client_ca.empty()) missing.push_back("worker mTLS (--tls-client-ca)");
  if (f.auth_token_file.empty()) missing.push_back("user tokens (--auth-token-file)");
  return absl::StrJoin(missing, ", ");
}

// Picks the address to listen on: loopback unless secured, and beyond loopback only
// when secured or --insecure. Errors: INVALID_ARGUMENT naming what is missing.
absl::StatusOr<std::string> BindAddress(const Flags& f) {
  const std::string missing = MissingSecurity(f);
  if (f.bind.empty()) return missing.empty() ? std::string("0.0.0.0") : std::string("127.0.0.1");
  if (IsLoopback(f.bind) || missing.empty() || f.insecure) return f.bind;
  return absl::InvalidArgumentError(absl::StrCat(
      "--bind ", f.bind, ": listening beyond loopback needs ", missing,
      " (pippyctl certs init DIR makes the certificates and a token file; see docs/security.md), or --insecure to "
      "run without them"));
}

// Adds "pippy-warning: TEXT" to the initial metadata of every call (pippyctl health
// prints it): an insecure coordinator says so to whoever asks.
class WarningInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit WarningInterceptor(const std::string* text) : text_(text) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("pippy-warning", *text_);
    }
    methods->Proceed();
  }

 private:
  const std::string* text_;
};

class WarningInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit WarningInterceptorFactory(std::string text) : text_(std::move(text)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new WarningInterceptor(&text_);
  }

 private:
  const std::string text_;
};

// Writes the port bound to --port-file (atomically: a reader never sees half of it).
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write --port-file ", path));
  }
  return absl::OkStatus();
}

// Runs the coordinator until SIGTERM or SIGINT.
int Serve(const Flags& f) {
  using namespace pippy;
  auto bind = BindAddress(f);
  if (!bind.ok()) return cli::Fail(kProgram, bind.status());
  absl::Status caught = CatchStopSignals();
  if (!caught.ok()) return cli::Fail(kProgram, caught);
  coordinator::Coordinator::Options opts;
  opts.state_dir = f.state_dir;
  opts.heartbeat_timeout = absl::Seconds(f.heartbeat_timeout_s);
  opts.max_queued_per_user = f.max_queued;
  opts.child_binary = "/proc/self/exe";
  opts.prepare_timeout = absl::Seconds(f.prepare_timeout_s);
  opts.probe_timeout = absl::Seconds(f.probe_timeout_s);
  opts.dataset_roots = f.dataset_roots;
  opts.job_retention = absl::Seconds(f.job_retention_days * 86400);
  opts.max_finished_jobs = f.max_finished_jobs;
  opts.max_message_bytes = int64_t{f.max_message_mib} << 20;
  test_hooks::SetStallOnJobName(f.test_stall_on_job_name);
  auto logic = coordinator::Coordinator::Create(opts);
  if (!logic.ok()) return cli::Fail(kProgram, logic.status());
  g_coordinator = logic->get();
  std::unique_ptr<metrics::Server> metrics_server;
  if (f.metrics_port >= 0) {
    coordinator::Coordinator* c = logic->get();
    auto started = metrics::Server::Start(*bind, f.metrics_port, [c] { return c->MetricsText(); });
    if (!started.ok()) return cli::Fail(kProgram, started.status());
    metrics_server = std::move(*started);
    log::Info("metrics on http://{}:{}/metrics", *bind, metrics_server->port());
  }
  std::unique_ptr<coordinator::TokenAuth> auth;
  if (!f.auth_token_file.empty()) {
    auto loaded = coordinator::TokenAuth::Load(f.auth_token_file);
    if (!loaded.ok()) return cli::Fail(kProgram, loaded.status());
    auth = std::move(*loaded);
    log::Info("user tokens: {} user(s) from {}", auth->users(), f.auth_token_file);
  }
  coordinator::Limits limits;
  limits.max_model_bytes = f.max_model_mib << 20;
  limits.max_data_bytes = f.max_data_mib << 20;
  limits.max_dataset_bytes = f.max_dataset_upload_gib << 30;
  limits.max_concurrent_streams = f.max_streams;
  limits.stream_idle_timeout = absl::Seconds(f.stream_idle_timeout_s);
  coordinator::CoordinatorGrpc api(logic->get(), auth.get(), limits);
  auto credentials = tls::ServerCredentials(f.tls_files);
  if (!credentials.ok()) return cli::Fail(kProgram, credentials.status());
  coordinator::WorkerHubGrpc hub(logic->get(), /*require_client_cert=*/!f.tls_files.client_ca.empty());
  // grpc.health.v1.Health: SERVING from the start (the state store is open by now).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(*bind, ":", f.port), *credentials, &bound);
  const std::string missing = MissingSecurity(f);
  std::string warning;
  if (!missing.empty() && !IsLoopback(*bind)) {
    warning = absl::StrCat("INSECURE: listening on ", *bind, " without ", missing,
                           " (--insecure): anyone who reaches this port can register as a worker and receive users' "
                           "models and data, or submit and cancel jobs");
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<WarningInterceptorFactory>(warning));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  builder.SetMaxReceiveMessageSize(f.max_message_mib << 20);
  // gRPC sets SO_REUSEPORT by default: a second coordinator on the port would share it,
  // the kernel splitting clients and workers between the two. Refused instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&api);
  builder.RegisterService(&hub);
  g_server = builder.BuildAndStart();
  if (!g_server || bound == 0) {
    const std::string owner = PortOwner(f.port);
    return cli::Fail(kProgram, absl::FailedPreconditionError(absl::StrCat(
                                   "--port ", f.port, ": cannot listen on ", *bind, ":", f.port,
                                   owner.empty() ? "" : absl::StrCat(": in use by ", owner),
                                   " (stop it, or give another --port; --port 0 picks a free one)")));
  }
  if (!f.port_file.empty()) {
    absl::Status written = WritePortFile(f.port_file, bound);
    if (!written.ok()) return cli::Fail(kProgram, written);
  }
  g_server->GetHealthCheckService()->SetServingStatus(true);
  log::Info("pippy-coordinator listening on {}:{}{}{} (state in {})", *bind, bound,
            f.tls_files.cert.empty()             ? ""
            : f.tls_files.client_ca.empty()      ? " over TLS"
                                                 : " over TLS, workers with mTLS",
            f.auth_token_file.empty() ? "" : ", user tokens", f.state_dir);
  if (!warning.empty()) {
    log::Warn("{}", warning);
  } else if (!missing.empty()) {
    log::Info("loopback only: without {}, only this host can reach it (--bind another address needs them, or "
              "--insecure)", missing);
  }
  systemd::NotifyReady(absl::StrCat("serving on ", *bind, ":", bound));
  // Health tells the truth about the coordinator's own loop: NOT_SERVING (and no
  // watchdog pings) while it has not turned for 10 s, SERVING again when it does.
  const absl::Duration stall = absl::Seconds(10);
  std::atomic<bool> monitoring{true};
  std::thread monitor([&monitoring, stall] {
    bool serving = true;
    while (monitoring) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      const bool alive = g_coordinator->LoopAlive(stall) && !g_stopping;
      if (alive == serving || g_stopping) continue;
      serving = alive;
      g_server->GetHealthCheckService()->SetServingStatus(alive);
      if (alive) {
        log::Info("the coordinator's loop turns again: health SERVING");
      } else {
        log::Warn("the coordinator's loop has not turned for {}: health NOT_SERVING", absl::FormatDuration(stall));
      }
    }
  });
  systemd::StartWatchdog([stall] { return g_coordinator->LoopAlive(stall); });
  // SIGTERM and SIGINT only write a byte to a pipe (async-signal-safe); this thread
  // reads it and stops the coordinator as ordinary code, not in a handler.
  // Children preparing or merging are killed at once; workers keep their streams open
  // forever: what is still open after 0.3 s is cancelled. Should a handler still not
  // return (it never has), the process exits at 1.8 s: everything it keeps is in
  // SQLite transactions and files renamed into place.
  std::thread signals([] {
    unsigned char sig = 0;
    while (read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
    }
    pippy::log::Info("pippy-coordinator stopping ({})", sig == SIGINT ? "SIGINT" : "SIGTERM");
    g_stopping = true;
    systemd::NotifyStopping();
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1800));
      std::fputs("pippy-coordinator did not stop within 1.8 s of the signal; exiting now\n", stderr);
      std::_Exit(0);
    }).detach();
    g_coordinator->BeginStop();
    g_server->GetHealthCheckService()->SetServingStatus(false);
    g_server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  });
  g_server->Wait();
  signals.join();
  monitoring = false;
  monitor.join();
  g_server.reset();
  logic->reset();  // its loop and task threads joined
  log::Info("pippy-coordinator stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pippy;
  UseTransparentHugePages(argv);  // its children load and write stages (memory.h)
  KeepFreedMemoryForStreams(/*max_arenas=*/2);  // uploads, stage files and merged models stream through it (memory.h)
  // The children that prepare a submission and merge a trained model (child_process.h).
  // They end with _Exit once their files are closed: no static destructors (LibTorch's
  // thread pools among them) can keep a finished child from exiting, which its parent
  // would wait for until the child's deadline.
  if (argc >= 3 && std::string(argv[1]) == coordinator::kPrepareFlag) {
    bool whole = false;
    std::vector<std::string> dataset_roots;
    for (int i = 3; i < argc; ++i) {
      if (std::string(argv[i]) == coordinator::kWholeFlag) whole = true;
      if (std::string(argv[i]) == coordinator::kDatasetRootFlag && i + 1 < argc) dataset_roots.push_back(argv[++i]);
    }
    const int code = coordinator::RunPreparationChild(argv[2], whole, dataset_roots);
    std::fflush(nullptr);
    std::_Exit(code);
  }
  if (argc == 4 && std::string(argv[1]) == coordinator::kMergeFlag) {
    const int code = coordinator::RunMergeChild(argv[2], std::atoi(argv[3]));
    std::fflush(nullptr);
    std::_Exit(code);
  }
  CLI::App app("Splits submitted TorchScript models into pipeline stages, places them on pippy-worker "
               "daemons and follows the jobs (docs/api.md).",
               kProgram);
  cli::Configure(app);
  Flags f;
  AddFlags(app, &f);
  if (auto code = cli::Parse(app, argc, argv)) return *code;
  absl::Status logging = log::InitWithLevel("coordinator", f.log_level);
  if (!logging.ok()) return cli::Fail(kProgram, logging);
  return Serve(f);
}
