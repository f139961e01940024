#include "worker/session.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_limits.h"
#include "common/log.h"
#include "common/port_owner.h"
#include "common/status.h"
#include "common/systemd.h"
#include "common/tls.h"
#include "proto/health.grpc.pb.h"

namespace pippy::worker {

// grpc.health.v1.Health for --health-port: the whole server ("") and pippy.Worker.
class Session::HealthService : public grpc::health::v1::Health::Service {
 public:
  std::atomic<bool> serving{false};

  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override {
    if (!request->service().empty() && request->service() != "pippy.Worker") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service (ask for \"\" or pippy.Worker)");
    }
    response->set_status(serving ? grpc::health::v1::HealthCheckResponse::SERVING
                                 : grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }
};

Session::Session(Options options, std::function<RegisterWorker()> registration, Handler* handler)
    : options_(std::move(options)),
      registration_(std::move(registration)),
      handler_(handler),
      health_service_(std::make_unique<HealthService>()) {}

Session::~Session() {
  if (health_server_) health_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

absl::Status Session::Run() {
  if (options_.health_port >= 0) {
    grpc::ServerBuilder builder;
    builder.RegisterService(health_service_.get());
    int bound = 0;
    builder.AddListeningPort(absl::StrCat("0.0.0.0:", options_.health_port), grpc::InsecureServerCredentials(), &bound);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is refused, not shared
    health_server_ = builder.BuildAndStart();
    if (!health_server_ || bound == 0) {
      const std::string owner = PortOwner(options_.health_port);
      return absl::FailedPreconditionError(absl::StrCat(
          "--health-port ", options_.health_port, ": the port is in use", owner.empty() ? "" : absl::StrCat(" by ", owner),
          "; choose another --health-port (or --port-offset), or 0 for any free one"));
    }
    log::Info("health checks (grpc.health.v1.Health) on port {}", bound);
  }
  absl::Status s = Connect(options_.connect_timeout);
  while (absl::IsUnavailable(s) && registered_once_ && options_.reconnect_timeout > absl::ZeroDuration()) {
    const absl::Time deadline = absl::Now() + options_.reconnect_timeout;
    log::Warn("lost the coordinator at {} ({}); reconnecting for up to {}", options_.coordinator, s.message(),
              absl::FormatDuration(options_.reconnect_timeout));
    absl::Duration backoff = absl::Milliseconds(200);
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::UnavailableError(absl::StrCat("lost the coordinator at ", options_.coordinator,
                                                   " and could not reconnect within ",
                                                   absl::FormatDuration(options_.reconnect_timeout),
                                                   " (--reconnect-timeout-s): ", s.message()));
      }
      s = Connect(std::min(left, absl::Seconds(5)));
      if (registered_ || !absl::IsUnavailable(s)) break;  // served (and lost again), or done
      absl::SleepFor(std::min(backoff, std::max(absl::ZeroDuration(), deadline - absl::Now())));
      backoff = std::min(backoff * 2, absl::Seconds(5));
    }
  }
  return s;
}

std::string Session::WhyUnreachable(const std::shared_ptr<grpc::Channel>& channel) const {
  if (options_.tls_ca.empty()) return "";
  // A refused TLS handshake looks like an unreachable host to WaitForConnected; one
  // call on the channel says which it was.
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext probe;
  probe.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::Status st = grpc::health::v1::Health::NewStub(channel)->Check(&probe, req, &resp);
  if (st.ok()) return "";
  return absl::StrCat(" (", st.error_message(), "; with TLS, check that --tls-ca signed the coordinator's "
                      "certificate and, for mTLS, that the coordinator's --tls-client-ca signed --tls-cert)");
}

absl::Status Session::Connect(absl::Duration connect_timeout) {
  registered_ = false;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kWorkerMaxMessageBytes));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  PIPPY_ASSIGN_OR_RETURN(auto credentials,
                         tls::ChannelCredentials({options_.tls_ca, options_.tls_cert, options_.tls_key}));
  auto channel = grpc::CreateCustomChannel(options_.coordinator, credentials, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", options_.coordinator, " within ",
                                               absl::FormatDuration(connect_timeout), WhyUnreachable(channel)));
  }
  auto stub = WorkerHub::NewStub(channel);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<WorkerMessage, CoordinatorMessage>> stream = stub->Connect(&ctx);
  {
    absl::MutexLock lock(&write_mu_);
    stream_ = stream.get();
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = false;
  }
  WorkerMessage reg;
  *reg.mutable_register_() = registration_();
  reg.mutable_register_()->set_worker_id(worker_id_);
  auto finish = [&](absl::string_view when) -> absl::Status {
    {
      absl::MutexLock lock(&write_mu_);
      stream_ = nullptr;
    }
    grpc::Status fin = stream->Finish();
    if (fin.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return absl::UnauthenticatedError(absl::StrCat("the coordinator refused this worker: ", fin.error_message()));
    }
    return absl::UnavailableError(absl::StrCat(when, fin.ok() ? "closed by the coordinator" : fin.error_message()));
  };
  if (!Write(reg)) return finish("the coordinator closed the stream at registration: ");
  std::thread heartbeat([this] {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) break;
      }
      WorkerMessage hb;
      hb.mutable_heartbeat()->set_unix_ms(absl::ToUnixMillis(absl::Now()));
      if (!Write(hb)) break;
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.heartbeat);
    }
  });
  CoordinatorMessage m;
  while (stream->Read(&m)) {
    if (m.has_registered()) {
      OnRegistered(m.registered().worker_id());
    } else {
      handler_->OnMessage(m);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  SetHealth(false);
  handler_->OnDisconnected();
  heartbeat.join();
  return finish("stream to the coordinator ended: ");
}

void Session::OnRegistered(const std::string& id) {
  if (!worker_id_.empty() && worker_id_ != id) {
    log::Warn("registered again as {} (was {}: that id is taken)", id, worker_id_);
  }
  worker_id_ = id;
  registered_ = true;
  registered_once_ = true;
  SetHealth(true);
  log::Info("registered as {} with the coordinator at {}", worker_id_, options_.coordinator);
}

void Session::SetHealth(bool serving) {
  health_service_->serving = serving;
  registered_now_ = serving;
  // systemd (Type=notify): ready once registered; the status line follows.
  if (serving) {
    systemd::NotifyReady(absl::StrCat("registered as ", worker_id_, " with ", options_.coordinator));
  } else {
    systemd::NotifyStatus(absl::StrCat("reconnecting to the coordinator at ", options_.coordinator));
  }
}

bool Session::Write(const WorkerMessage& m) {
  absl::MutexLock lock(&write_mu_);
  return stream_ != nullptr && stream_->Write(m);
}

}  // namespace pippy::worker
