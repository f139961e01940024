// The worker daemon's agent: dials out to the coordinator (one long-lived Connect
// stream, so workers need no inbound gRPC port), registers, sends heartbeats, and
// runs the ranks it is assigned with the stage runtime over UCX, reporting each step
// and finally sending its trained stages back.
//
// Threads: Run()'s thread reads the stream; a heartbeat thread writes heartbeats; one
// job thread runs the assigned rank. Writes to the stream are serialised by a mutex.
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
  absl::Duration heartbeat = absl::Seconds(1);
  absl::Duration wait_timeout = absl::Seconds(60);  // each wait inside a step
};

// Connects and serves until the coordinator closes the stream or it breaks.
// Errors: UNAVAILABLE when the coordinator cannot be reached or the stream broke.
absl::Status RunAgent(const AgentOptions& options);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_WORKER_AGENT_H_
