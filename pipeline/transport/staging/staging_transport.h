// "ucx+staging": transfers for a rank whose tensors live on a device (a GPU) over a
// transport that moves host memory (UCX), for the edges NCCL cannot serve — two
// workers sharing one GPU, or a GPU rank and a CPU rank (job::TransportFor).
//
// A send copies the value's device tensors to host memory, then posts the host copy on
// the inner transport; a receive's value comes back with its tensors copied onto the
// rank's device when it is waited for. The copies are a DeviceCopier's
// (device_copier.h):
//   - on a CUDA device (ForDevice), pinned host buffers and a copy stream of its own:
//     Send() returns once the device-to-host copies are queued, and a thread of this
//     transport posts the host copy when they have finished — the rank's thread goes on
//     queueing compute meanwhile. Sends are posted in the order Send() was called, so
//     the ordering guarantee of transport.h holds.
//   - elsewhere (SyncCopier), on the caller's thread and stream.
// Values without device tensors are posted at once when no staged send is ahead of
// them, so a StagingTransport on a CPU rank is the inner transport.
//
// Errors: a failed copy fails the send (the message is never posted); a copy that does
// not finish within `copy_timeout` fails it with DEADLINE_EXCEEDED. Destroying the
// transport fails the sends it has not posted yet with CANCELLED.
//
// Thread safety and ownership: as transport.h; the inner transport must outlive this.
#ifndef PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_

#include <deque>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "c10/core/Device.h"
#include "pipeline/transport/staging/device_copier.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::staging {

class StagedSend;

class StagingTransport : public Transport {
 public:
  // The transport for a rank on `device`: the CUDA copier on a CUDA device, synchronous
  // copies elsewhere. Errors: NewCudaCopier's.
  static absl::StatusOr<std::unique_ptr<StagingTransport>> ForDevice(Transport* host, const c10::Device& device);

  // `host`: the transport that moves host memory; `device`: where this rank's tensors
  // live (synchronous copies).
  StagingTransport(Transport* host, c10::Device device);
  // Copies by `copier`, whose device is this rank's.
  StagingTransport(Transport* host, std::unique_ptr<DeviceCopier> copier,
                   absl::Duration copy_timeout = absl::Minutes(5));
  ~StagingTransport() override;

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) override;
  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override;

  const c10::Device& device() const { return copier_->device(); }

 private:
  struct Pending {
    std::shared_ptr<StagedSend> work;
    int peer = 0;
    Tag tag;
    DeviceCopier::Staged staged;
  };

  void Loop();  // the poster thread: each pending send once its copies are done

  Transport* const host_;
  const std::unique_ptr<DeviceCopier> copier_;
  const absl::Duration copy_timeout_;
  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool posting_ ABSL_GUARDED_BY(mu_) = false;  // the thread holds a send taken off the queue
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started by the first staged send
};

}  // namespace pippy::transport::staging

#endif  // PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_
