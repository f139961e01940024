// The worker's connection to its coordinator: dials out (plain or TLS; workers need no
// inbound port), registers, sends heartbeats, and hands every message it reads to a
// Handler. When the stream ends it tells the handler (the rank it runs stops: its job
// resumes from a checkpoint) and dials again with backoff, registering under the id it
// had, until reconnect_timeout has passed. While registered, grpc.health.v1 on
// health_port answers SERVING and systemd is told READY.
//
// Threads: Run() reads the stream and calls the handler on its own thread; a heartbeat
// thread per connection writes heartbeats; Write may be called from any thread (writes
// are serialised).
#ifndef PIPPY_WORKER_SESSION_H_
#define PIPPY_WORKER_SESSION_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"

namespace pippy::worker {

class Session {
 public:
  struct Options {
    std::string coordinator = "localhost:7070";
    std::string tls_ca, tls_cert, tls_key;     // empty: plain
    absl::Duration heartbeat = absl::Seconds(1);
    absl::Duration connect_timeout = absl::Seconds(10);
    absl::Duration reconnect_timeout = absl::Seconds(300);  // 0: give up at once
    int health_port = -1;                        // -1: none
  };

  // What reading the stream asks of the worker; called on Run()'s thread.
  class Handler {
   public:
    virtual ~Handler() = default;
    virtual void OnMessage(const CoordinatorMessage& message) = 0;
    // The stream ended: stop the rank, drop what was arriving.
    virtual void OnDisconnected() = 0;
  };

  // `registration` makes the RegisterWorker message of each (re)connection (its
  // worker_id is filled in here). `handler` must outlive the Session.
  Session(Options options, std::function<RegisterWorker()> registration, Handler* handler);
  ~Session();

  // Serves until the coordinator is lost for good.
  // Errors: UNAVAILABLE when the coordinator cannot be reached at first (within
  // connect_timeout) or again (within reconnect_timeout); UNAUTHENTICATED when it
  // refuses this worker (TLS).
  absl::Status Run();

  // Writes one message to the coordinator. False when the stream is gone.
  bool Write(const WorkerMessage& message);

  // Whether the worker is registered now (for /metrics).
  bool registered() const { return registered_now_.load(); }
  // The id the coordinator gave (kept across reconnections). Run()'s thread only.
  const std::string& worker_id() const { return worker_id_; }

 private:
  class HealthService;
  // One connection: registers, serves until the stream ends.
  absl::Status Connect(absl::Duration connect_timeout);
  std::string WhyUnreachable(const std::shared_ptr<grpc::Channel>& channel) const;
  void OnRegistered(const std::string& id);
  void SetHealth(bool serving);

  const Options options_;
  const std::function<RegisterWorker()> registration_;
  Handler* const handler_;
  std::unique_ptr<HealthService> health_service_;
  std::unique_ptr<grpc::Server> health_server_;
  absl::Mutex write_mu_;  // one writer at a time on the stream
  // The current connection's stream (owned by Connect); null between connections.
  grpc::ClientReaderWriter<WorkerMessage, CoordinatorMessage>* stream_ ABSL_GUARDED_BY(write_mu_) = nullptr;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the current connection is ending
  std::atomic<bool> registered_now_{false};
  // Run()'s thread only.
  std::string worker_id_;
  bool registered_ = false;       // in the current connection
  bool registered_once_ = false;
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_SESSION_H_
