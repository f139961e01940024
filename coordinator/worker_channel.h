// How the coordinator's logic reaches one connected worker: its stream, as an
// interface, so that the logic has no gRPC types (grpc_service.cc implements it over a
// worker's Connect stream; the tests with fakes).
#ifndef PIPPY_COORDINATOR_WORKER_CHANNEL_H_
#define PIPPY_COORDINATOR_WORKER_CHANNEL_H_

#include <memory>
#include <utility>
#include <vector>

#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// Send returns false when the stream is gone. Send may be called from several threads
// at once (the implementation orders them), and may block while the worker is slow to
// read.
class WorkerChannel {
 public:
  virtual ~WorkerChannel() = default;
  virtual bool Send(const CoordinatorMessage& message) = 0;
};

// Messages decided under the coordinator's mutex and sent after it is released.
using Outbox = std::vector<std::pair<std::shared_ptr<WorkerChannel>, CoordinatorMessage>>;

// Sends every message of `out` and empties it.
inline void Deliver(Outbox* out) {
  for (auto& [channel, message] : *out) channel->Send(message);
  out->clear();
}

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_WORKER_CHANNEL_H_
