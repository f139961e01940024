#include "worker/rank_bringup.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/transport/staging/device_copier.h"
#include "pipeline/transport/staging/staging_transport.h"

namespace pippy::worker {
namespace {

int64_t ParamBytes(const torch::jit::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.named_parameters(true)) n += static_cast<int64_t>(p.value.numel() * p.value.element_size());
  return n;
}

}  // namespace

absl::StatusOr<LoadedStages> LoadStages(std::map<int, std::string> archives) {
  LoadedStages out;
  for (auto& [s, bytes] : archives) {
    PIPPY_ASSIGN_OR_RETURN(torch::jit::Module module, torchio::LoadModelFromBytes(bytes, absl::StrCat("stage ", s)));
    out.param_bytes += ParamBytes(module);
    out.modules.emplace(s, std::move(module));
    std::string().swap(bytes);  // the archive's bytes are not needed once loaded
  }
  return out;
}

absl::StatusOr<LoadedStages> LoadStageFiles(const std::string& dir, const std::vector<int>& stages) {
  LoadedStages out;
  for (int s : stages) {
    PIPPY_ASSIGN_OR_RETURN(torch::jit::Module module, torchio::LoadModel(absl::StrCat(dir, "/stage_", s, ".pt")));
    out.param_bytes += ParamBytes(module);
    out.modules.emplace(s, std::move(module));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RankTransports>> RankTransports::Create(
    int rank, int world, c10::Device device, const std::vector<std::pair<std::string, std::string>>& ucx_config) {
  std::unique_ptr<RankTransports> t(new RankTransports());
  t->device_ = device;
  transport::ucx::Options uo;
  uo.ucx_config = ucx_config;
  uo.receive_buffer = transport::staging::ReceiveBuffersFor(device);  // pinned on a GPU
  PIPPY_ASSIGN_OR_RETURN(t->ucx_, transport::ucx::UcxTransport::Create(rank, world, uo));
  t->address_ = t->ucx_->address();
  return t;
}

absl::Status RankTransports::Connect(const std::vector<std::string>& addresses) {
  PIPPY_RETURN_IF_ERROR(ucx_->Connect(addresses));
  // A GPU rank's tensors cross to other ranks through host memory (ucx+staging).
  PIPPY_ASSIGN_OR_RETURN(staged_, transport::staging::StagingTransport::ForDevice(ucx_.get(), device_));
  return absl::OkStatus();
}

}  // namespace pippy::worker
