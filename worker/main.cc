// pippy-worker: parses flags and runs the agent; nothing else.
#include <cstdlib>
#include <iostream>

#include "client/args.h"
#include "client/exit_codes.h"
#include "common/log.h"
#include "worker/worker_agent.h"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {
constexpr char kHelp[] = R"(usage: pippy-worker [--coordinator HOST:PORT] [--device cpu] [--name N] [--threads N]
                    [--ucx-tls TLS] [--wait-timeout-s S] [--log-level L]

  --coordinator   where the coordinator listens (default $PIPPY_COORDINATOR, else localhost:7070)
  --device        cpu (this build's LibTorch is CPU-only)
  --name          how the worker appears in `pippyctl workers` (default host:pid)
  --threads       compute threads for LibTorch and OpenBLAS (default 1)
  --ucx-tls       UCX transports for the data plane (default: UCX chooses; e.g. sm,self or tcp,self)
  --wait-timeout-s  deadline of every wait inside a training step (default 60)
)";
}  // namespace

int main(int argc, char** argv) {
  using namespace pippy;
  auto args = cli::Args::Parse(argc, argv, 1,
                               {{"coordinator"}, {"device"}, {"name"}, {"threads"}, {"ucx-tls"}, {"wait-timeout-s"},
                                {"log-level"}});
  if (!args.ok()) return cli::Fail(args.status());
  if (args->Has("help")) {
    std::cout << kHelp;
    return 0;
  }
  absl::Status logging = log::InitWithLevel("worker", args->Get("log-level", "info"));
  if (!logging.ok()) return cli::Fail(logging);
  worker::AgentOptions o;
  const char* env = std::getenv("PIPPY_COORDINATOR");
  o.coordinator = args->Get("coordinator", env ? env : "localhost:7070");
  o.device = args->Get("device", "cpu");
  o.name = args->Get("name");
  auto threads = args->GetInt("threads", 1);
  auto wait = args->GetDouble("wait-timeout-s", 60);
  if (!threads.ok()) return cli::Fail(threads.status());
  if (!wait.ok()) return cli::Fail(wait.status());
  o.threads = *threads;
  o.wait_timeout = absl::Seconds(*wait);
  o.ucx_tls = args->Get("ucx-tls");
  if (openblas_set_num_threads) openblas_set_num_threads(o.threads);
  absl::Status s = worker::RunAgent(o);
  if (!s.ok()) return cli::Fail(s);
  return 0;
}
