// pippy-worker: parses flags and runs the agent; nothing else.
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/test_hooks.h"
#include "worker/worker_agent.h"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {
constexpr char kProgram[] = "pippy-worker";
}  // namespace

int main(int argc, char** argv) {
  using namespace pippy;
  UseTransparentHugePages(argv);  // stages arrive in and load into large buffers (memory.h)
  KeepFreedMemoryForStreams();  // its stages arrive as a stream of chunks (memory.h)
  CLI::App app("Registers with a pippy-coordinator and runs the pipeline ranks it is assigned (one per job at a "
               "time), receiving only its own stages.",
               kProgram);
  cli::Configure(app);
  worker::AgentOptions o;
  double wait_timeout_s = 60;
  double reconnect_timeout_s = 300;
  std::string log_level = "info";
  app.add_option("--coordinator", o.coordinator, "where the coordinator listens (HOST:PORT)")
      ->envname("PIPPY_COORDINATOR")->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu | cuda[:N] | auto (auto: the LOCAL_RANK-th visible GPU if this build's LibTorch has CUDA and "
                 "sees one, else cpu; cuda needs a LibTorch with CUDA)")
      ->capture_default_str();
  app.add_option("--name", o.name, "how the worker appears in `pippyctl workers` (default host:pid)");
  app.add_option("--threads", o.threads, "compute threads for LibTorch and OpenBLAS")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--ucx-tls", o.ucx_tls, "UCX transports for the data plane (default: UCX chooses; e.g. sm,self "
                                         "or tcp,self)");
  app.add_option("--replica-host", o.replica_host,
                 "data parallelism (--replicas): the address the other replicas reach this worker at "
                 "(default: the host's name)");
  app.add_option("--wait-timeout-s", wait_timeout_s, "deadline of every wait inside a training step")
      ->check(cli::Positive())->capture_default_str();
  app.add_option("--reconnect-timeout-s", reconnect_timeout_s,
                 "after losing the coordinator, keep dialling it (with backoff) this long, then exit 3; "
                 "0: exit at once")
      ->check(cli::NonNegative())->capture_default_str();
  app.add_option("--health-port", o.health_port,
                 "serve grpc.health.v1.Health on this port (SERVING while registered with the coordinator; "
                 "Kubernetes grpc probes, pippyctl health); 0: any free port")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-port", o.metrics_port,
                 "serve Prometheus metrics at http://0.0.0.0:PORT/metrics (steps, step time, bytes moved, "
                 "checkpoints); 0: any free port")
      ->check(CLI::Range(0, 65535));
  int port_offset = 0;
  app.add_option("--port-offset", port_offset,
                 "added to --health-port and --metrics-port (a unit template's instance number: one set of ports "
                 "per worker on a host)")
      ->check(CLI::Range(0, 10000))->capture_default_str();
  app.add_option("--dataset-root", o.dataset_roots,
                 "a folder jobs' datasets (pippyctl submit --dataset) may be read from, symbolic links resolved; "
                 "repeat for several (default: none, datasets are refused)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--scratch-dir", o.scratch_dir,
                 "where the shards of datasets uploaded with a job (pippyctl submit --dataset-upload) are kept while "
                 "its rank runs (default: $TMPDIR or /tmp)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--tls-ca", o.tls_ca, "TLS to the coordinator: the CA that signed its certificate (PEM)")
      ->envname("PIPPY_TLS_CA")->check(CLI::ExistingFile);
  app.add_option("--tls-cert", o.tls_cert, "this worker's client certificate for mTLS (PEM; with --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", o.tls_key, "the client certificate's private key (PEM)")->check(CLI::ExistingFile);
  app.add_option("--log-level", log_level, "debug | info | warn | error")
      ->check(CLI::IsMember({"debug", "info", "warn", "error", "off"}))->capture_default_str();
  // Test builds only, hidden (no --help line): a fault for the e2e tests.
  int die_in_checkpoint = -1;
  if (test_hooks::Enabled()) app.add_option("--test-die-in-checkpoint", die_in_checkpoint)->group("");
  if (auto code = cli::Parse(app, argc, argv)) return *code;
  absl::Status logging = log::InitWithLevel("worker", log_level);
  if (!logging.ok()) return cli::Fail(kProgram, logging);
  for (int* port : {&o.health_port, &o.metrics_port}) {
    if (*port <= 0) continue;  // none, or any free port
    *port += port_offset;
    if (*port > 65535) {
      return cli::Fail(kProgram, absl::InvalidArgumentError(absl::StrCat(
                                     "--port-offset ", port_offset, ": a port beyond 65535 (", *port,
                                     "); give smaller base ports or offsets")));
    }
  }
  test_hooks::SetDieInCheckpoint(die_in_checkpoint);
  o.wait_timeout = absl::Seconds(wait_timeout_s);
  o.reconnect_timeout = absl::Seconds(reconnect_timeout_s);
  if (openblas_set_num_threads) openblas_set_num_threads(o.threads);
  absl::Status s = worker::RunAgent(o);
  if (!s.ok()) return cli::Fail(kProgram, s);
  return cli::kExitOk;
}
