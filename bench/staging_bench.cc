// Staged-UCX ("ucx+staging") activation bandwidth: round trips of a tensor on the
// device through transport/staging over UCX to an echo peer process (ucx_peer) and
// back onto the device, side by side with a plain device -> host -> device copy round
// trip of the same bytes (the copies alone, which staging cannot beat). Two stagings:
// the rank's own (StagingTransport::ForDevice: on a GPU, pinned buffers and a copy
// stream) and the synchronous one (Tensor::to on the caller's stream). Prints a table
// with the ratios. On a CPU device both are the same and the "copies" are host
// memcpys (a smoke run).
//
//   staging_bench --peer PATH/ucx_peer [--device cuda:0|cpu] [--tls sm,self]
//                 [--mib 1,16,64] [--iters 20]
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "pipeline/transport/staging/staging_transport.h"
#include "pipeline/transport/ucx/peer_process.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "torch/cuda.h"

namespace {

using namespace pippy::transport;

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void Sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer_path, device_name = "cpu", tls = "sm,self", mib_list = "1,16,64";
  int iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--peer") peer_path = v;
    else if (k == "--device") device_name = v;
    else if (k == "--tls") tls = v;
    else if (k == "--mib") mib_list = v;
    else if (k == "--iters") (void)absl::SimpleAtoi(v, &iters);
  }
  if (peer_path.empty()) {
    std::cerr << "staging_bench: --peer PATH (the ucx_peer program) is required\n";
    return 2;
  }
  const c10::Device device(device_name);
  ucx::PeerProcess peer({peer_path, "--tls", tls, "--mode", "echo"});
  auto host = peer.Connect(ucx::LocalOptions(tls));
  if (!host.ok()) {
    std::cerr << "staging_bench: " << host.status() << "\n";
    return 1;
  }
  auto rank_staging = staging::StagingTransport::ForDevice(host->get(), device);
  if (!rank_staging.ok()) {
    std::cerr << "staging_bench: " << rank_staging.status() << "\n";
    return 1;
  }
  staging::StagingTransport sync_staging(host->get(), device);
  std::printf("%-8s %13s %13s %13s %13s %13s\n", "MiB", "staged GB/s", "sync GB/s", "copies GB/s", "staged/copies",
              "staged/sync");
  uint32_t mb = 0;
  for (const auto& piece : absl::StrSplit(mib_list, ',')) {
    int mib = 0;
    if (!absl::SimpleAtoi(piece, &mib) || mib <= 0) continue;
    const at::Tensor t = at::rand({static_cast<int64_t>(mib) << 18}, at::TensorOptions().device(device));
    const double bytes = 2.0 * static_cast<double>(t.numel() * t.element_size());  // there and back
    auto round_trip = [&](Transport& staged) -> bool {
      Tag tag;
      tag.microbatch = mb++ % 4096;
      auto s = staged.Send(1, tag, t);
      auto r = staged.Recv(1, tag);
      if (!s->Wait(absl::Seconds(60)).ok() || !r->Wait(absl::Seconds(60)).ok()) return false;
      at::Tensor back = r->Value().toTensor();
      Sync(device);
      return back.device() == device && back.numel() == t.numel();
    };
    auto time_staging = [&](Transport& staged) -> double {
      if (!round_trip(staged)) return -1;  // warm-up (registers the buffers)
      const double start = Now();
      for (int i = 0; i < iters; ++i) {
        if (!round_trip(staged)) return -1;
      }
      return (Now() - start) / iters;
    };
    const double staged_s = time_staging(**rank_staging), sync_s = time_staging(sync_staging);
    if (staged_s < 0 || sync_s < 0) {
      std::cerr << "staging_bench: a round trip of " << mib << " MiB failed\n";
      return 1;
    }
    at::Tensor pinned = at::empty_like(t, at::TensorOptions().device(c10::kCPU).pinned_memory(device.is_cuda()));
    pinned.copy_(t);
    Sync(device);
    const double start = Now();
    for (int i = 0; i < iters; ++i) {
      pinned.copy_(t);
      at::Tensor back = pinned.to(device, /*non_blocking=*/false, /*copy=*/true);
      Sync(device);
    }
    const double copies_s = (Now() - start) / iters;
    std::printf("%-8d %13.2f %13.2f %13.2f %13.2f %13.2f\n", mib, bytes / staged_s * 1e-9, bytes / sync_s * 1e-9,
                bytes / copies_s * 1e-9, copies_s / staged_s, sync_s / staged_s);
  }
  Tag stop;
  stop.microbatch = mb % 4096;
  (*host)->Send(1, stop, c10::IValue())->Wait(absl::Seconds(5)).IgnoreError();
  return 0;
}
