// The worker daemon's agent: dials out to the coordinator (one long-lived Connect
// stream, so workers need no inbound gRPC port), registers, sends heartbeats, and
// runs the ranks it is assigned with the stage runtime over UCX, reporting each step
// and finally streaming its trained stages back.
//
// A worker receives only its own stages' TorchScript files and its share of the data
// (never the whole model), loads the stages straight from the received bytes, frees
// the bytes, and sets the rank up with job::RankJob.
//
// Threads: Run()'s thread reads the stream and collects an assignment's files; a
// heartbeat thread writes heartbeats; one job thread loads and runs the assigned rank
// and sends its step reports, checkpoints and results.
// Writes to the stream are serialised by a mutex.
#ifndef PIPPY_WORKER_WORKER_AGENT_H_
#define PIPPY_WORKER_WORKER_AGENT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pippy::worker {

struct AgentOptions {
  std::string coordinator = "localhost:7070";
  std::string name;
  std::string device = "cpu";
  int threads = 1;
  std::string ucx_tls;  // empty: UCX chooses
  // Data parallelism: the address other replicas reach this worker's gloo endpoints at
  // (empty: the host's name).
  std::string replica_host;
  absl::Duration heartbeat = absl::Seconds(1);
  absl::Duration wait_timeout = absl::Seconds(60);  // each wait inside a step
  absl::Duration connect_timeout = absl::Seconds(10);
  // After losing the coordinator: how long to keep dialling (with backoff) before
  // giving up; 0: give up at once.
  absl::Duration reconnect_timeout = absl::Seconds(300);
  // grpc.health.v1.Health on this port (all interfaces): SERVING while registered with
  // the coordinator, NOT_SERVING while (re)connecting. -1: none.
  int health_port = -1;
  // Prometheus metrics at http://0.0.0.0:PORT/metrics. -1: none.
  int metrics_port = -1;
  // TLS to the coordinator: the CA that signed its certificate; this worker's
  // certificate and key for mTLS (--tls-client-ca on the coordinator). Empty: plain.
  std::string tls_ca, tls_cert, tls_key;
};

// Connects and serves. When the coordinator goes away (it stopped, restarted, or the
// network broke) the worker stops its rank and reconnects, registering under the id
// it had, for up to reconnect_timeout.
// Errors: UNAVAILABLE when the coordinator cannot be reached at first (within
// connect_timeout) or again (within reconnect_timeout);
// INVALID_ARGUMENT for options this build cannot serve (a device it lacks).
absl::Status RunAgent(const AgentOptions& options);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_WORKER_AGENT_H_
