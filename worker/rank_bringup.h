// Bringing a rank up, the one way the worker daemon and pippy-rank both do it: its
// stage modules loaded (from received bytes or from files), and its transport stack:
// UCX (on a GPU with pinned receive buffers) under ucx+staging, which moves a GPU
// rank's tensors through host memory (a CPU rank's pass through). The peers' addresses
// come from whoever places the ranks (the coordinator, or pippy-rank's rendezvous
// folder); once connected, job::RankJob runs on transport().
//
// Thread safety: a RankTransports is used by the rank's thread (and its runtime's).
#ifndef PIPPY_WORKER_RANK_BRINGUP_H_
#define PIPPY_WORKER_RANK_BRINGUP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "c10/core/Device.h"
#include "pipeline/transport/transport.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "torch/script.h"

namespace pippy::worker {

struct LoadedStages {
  std::map<int, torch::jit::Module> modules;  // stage -> module
  int64_t param_bytes = 0;                    // their parameters' bytes
};

// Loads each stage from its TorchScript archive's bytes, freeing the bytes of each once
// it is loaded. Errors: INVALID_ARGUMENT naming the stage (torchio::LoadModelFromBytes).
absl::StatusOr<LoadedStages> LoadStages(std::map<int, std::string> archives);

// Loads DIR/stage_<s>.pt for each of `stages` (what pippyctl split --out writes).
// Errors: NOT_FOUND or INVALID_ARGUMENT naming the file.
absl::StatusOr<LoadedStages> LoadStageFiles(const std::string& dir, const std::vector<int>& stages);

class RankTransports {
 public:
  // UCX for `rank` of `world` ranks with `ucx_config` (UCX settings such as TLS ->
  // sm,self), receiving into pinned host buffers when `device` is a GPU.
  // Errors: UCX's (UNAVAILABLE, INVALID_ARGUMENT naming the setting).
  static absl::StatusOr<std::unique_ptr<RankTransports>> Create(
      int rank, int world, c10::Device device, const std::vector<std::pair<std::string, std::string>>& ucx_config);

  // This rank's UCX address, for its peers.
  const std::string& address() const { return address_; }
  // Connects to every rank's address (by rank) and sets up staging for the device.
  // Errors: UCX's; INVALID_ARGUMENT for a device this build cannot stage.
  absl::Status Connect(const std::vector<std::string>& addresses);
  // The transport the rank's runtime uses. REQUIRES: Connect returned OK.
  transport::Transport* transport() { return staged_.get(); }

 private:
  RankTransports() = default;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::unique_ptr<transport::ucx::UcxTransport> ucx_;
  std::unique_ptr<transport::Transport> staged_;  // wraps ucx_: declared after it, destroyed before it
  std::string address_;
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_RANK_BRINGUP_H_
