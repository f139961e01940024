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
// heartbeat thread writes heartbeats; one job thread loads and runs the assigned rank.
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
  absl::Duration heartbeat = absl::Seconds(1);
  absl::Duration wait_timeout = absl::Seconds(60);  // each wait inside a step
  absl::Duration connect_timeout = absl::Seconds(10);
};

// Connects and serves until the coordinator closes the stream or it breaks.
// Errors: UNAVAILABLE when the coordinator cannot be reached or the stream broke;
// INVALID_ARGUMENT for options this build cannot serve (a device it lacks).
absl::Status RunAgent(const AgentOptions& options);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_WORKER_AGENT_H_
