// UCX backend of transport.h: one UCP context and worker per transport, endpoints to
// every peer, tagged messages.
//
// Wire format (docs/wire_protocol.md): each Send is two UCX tag messages with the
// same 64-bit UCX tag but for one "part" bit — an eager header that describes the
// value (structure, dtype and shape of each tensor, non-tensor leaves inline), then
// one message with every tensor's bytes (contiguous for one tensor, IOV for several),
// sent straight from the tensors' storage (non-contiguous tensors are made contiguous
// once) and received straight into freshly allocated (or reused) tensors. Values with
// at most 16 KiB of tensor bytes travel as one message, header and bytes together. No
// round trip is added for known or changed shapes. The UCX tag carries the sender's
// rank, so Recv(peer, tag) matches only `peer`.
// Limits: 256 ranks; Tag.index < 4096; steps are taken modulo 4096.
//
// Threads (docs/threading.md): every method may be called from any thread; every UCX
// call happens under one worker mutex. Send, Recv and Cancel make their UCX calls
// directly; a thread in Wait() drives UCX itself while the transfer moves (no thread
// hand-off on the critical path) and blocks once UCX has been idle for 1 ms. A
// background progress thread keeps UCX moving when nobody waits; it stands aside while
// callers drive and for 2 ms after, and sleeps on the worker's event fd
// (ucp_worker_arm) when idle, so an idle transport costs no CPU.
//
// Failure: endpoints use UCP_ERR_HANDLING_MODE_PEER with a keepalive (default 200 ms,
// UCX_KEEPALIVE_INTERVAL overrides), and shared-memory transports get
// UCX_MM_ERROR_HANDLING=y; when a peer dies, every pending operation with it fails
// with UNAVAILABLE naming the peer, and later ones fail at once — except receives of
// messages it sent before it went, which still arrive. Destroying a transport flushes
// its endpoints to live peers first (at most 2 s), so a rank that sends and exits loses
// nothing it sent.
//
// Deployment: UCX_TLS chooses transports (e.g. "sm,self" on one host, "tcp,self"
// across hosts), UCX_NET_DEVICES the NIC ("lo" for loopback tests).
#ifndef PIPPY_PIPELINE_TRANSPORT_UCX_UCX_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_UCX_UCX_TRANSPORT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::ucx {

struct Options {
  // UCX settings applied to this context ("TLS" -> "tcp,self", "NET_DEVICES" -> "lo");
  // environment variables UCX_* still win for anything not listed here.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  absl::Duration connect_timeout = absl::Seconds(30);
  // Where payloads of 64 KiB and more are received: a contiguous host byte tensor of
  // `nbytes` (unset: LibTorch's allocator). A GPU rank passes pinned memory
  // (staging::ReceiveBuffersFor), so that its host-to-device copies start from the
  // received bytes themselves. Buffers are reused as receive_pool.h describes; one of
  // the wrong kind is not used (the allocator's takes its place).
  std::function<at::Tensor(int64_t nbytes)> receive_buffer;
};

class UcxTransport : public Transport {
 public:
  // Creates the context and worker and starts the progress thread.
  // Errors: UNAVAILABLE with UCX's message when UCX cannot start.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(int rank, int world_size, const Options& options = {});

  // This worker's address, to hand to the peers (through the control plane).
  virtual std::string address() const = 0;

  // Connects to every rank (addresses indexed by rank, this one's included) and
  // waits until each peer has connected back (a hello from every rank), so failures
  // are detected from then on. Errors: DEADLINE_EXCEEDED naming the missing ranks.
  virtual absl::Status Connect(const std::vector<std::string>& addresses) = 0;

  // Operations whose buffers UCX still holds (diagnostics and tests): 0 once every
  // posted Send and Recv has completed.
  virtual size_t operations_in_flight() = 0;
};

// Creates `n` connected transports in this process (tests and benchmarks).
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLocalGroup(int n, const Options& options = {});

}  // namespace pippy::transport::ucx

#endif  // PIPPY_PIPELINE_TRANSPORT_UCX_UCX_TRANSPORT_H_
