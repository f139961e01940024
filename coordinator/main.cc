// pippy-coordinator: wires the service logic to gRPC and parses flags; nothing else.
#include <chrono>
#include <csignal>
#include <thread>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "client/args.h"
#include "client/exit_codes.h"
#include "common/log.h"
#include "coordinator/grpc_service.h"
#include "grpcpp/grpcpp.h"

namespace {

constexpr char kHelp[] = R"(usage: pippy-coordinator [--bind ADDR] [--port P] [--state-dir DIR]
                         [--heartbeat-timeout-s S] [--port-file FILE] [--log-level L]

  --bind ADDR            address to listen on (default 0.0.0.0)
  --port P               gRPC port (default 7070; 0 lets the OS choose — see --port-file)
  --state-dir DIR        job records (SQLite) and trained models (default ./pippy-state)
  --heartbeat-timeout-s  a worker silent this long is removed and its job fails (default 10)
  --port-file FILE       write the port actually bound (for port 0)
  --log-level L          debug | info | warn | error (default info)
)";

std::unique_ptr<grpc::Server> g_server;

}  // namespace

int main(int argc, char** argv) {
  using namespace pippy;
  auto args = cli::Args::Parse(argc, argv, 1,
                               {{"bind"}, {"port"}, {"state-dir"}, {"heartbeat-timeout-s"}, {"port-file"}, {"log-level"}});
  if (!args.ok()) return cli::Fail(args.status());
  if (args->Has("help")) {
    std::cout << kHelp;
    return 0;
  }
  absl::Status logging = log::InitWithLevel("coordinator", args->Get("log-level", "info"));
  if (!logging.ok()) return cli::Fail(logging);
  auto port = args->GetInt("port", 7070);
  auto hb = args->GetDouble("heartbeat-timeout-s", 10);
  if (!port.ok()) return cli::Fail(port.status());
  if (!hb.ok()) return cli::Fail(hb.status());
  coordinator::Coordinator::Options opts;
  opts.state_dir = args->Get("state-dir", "pippy-state");
  opts.heartbeat_timeout = absl::Seconds(*hb);
  auto logic = coordinator::Coordinator::Create(opts);
  if (!logic.ok()) return cli::Fail(logic.status());
  coordinator::CoordinatorGrpc api(logic->get());
  coordinator::WorkerHubGrpc hub(logic->get());
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(args->Get("bind", "0.0.0.0"), ":", *port), grpc::InsecureServerCredentials(),
                           &bound);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(&api);
  builder.RegisterService(&hub);
  g_server = builder.BuildAndStart();
  if (!g_server || bound == 0) {
    return cli::Fail(absl::UnavailableError(absl::StrCat("cannot listen on port ", *port, " (in use?)")));
  }
  if (args->Has("port-file")) {
    const std::string tmp = args->Get("port-file") + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    std::rename(tmp.c_str(), args->Get("port-file").c_str());
  }
  log::Info("pippy-coordinator listening on {}:{} (state in {})", args->Get("bind", "0.0.0.0"), bound, opts.state_dir);
  // Workers keep their streams open forever: cancel what is still open after 2 s.
  auto stop = [](int) {
    std::thread([] { g_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2)); }).detach();
  };
  std::signal(SIGTERM, stop);
  std::signal(SIGINT, stop);
  g_server->Wait();
  log::Info("pippy-coordinator stopped");
  return 0;
}
