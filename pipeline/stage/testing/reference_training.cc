#include "pipeline/stage/testing/reference_training.h"

#include <map>
#include <set>

#include "pipeline/stage/microbatch.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/nn/utils/clip_grad.h"

namespace pippy::stage::testing {

double RelDiff(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor da = a.detach().to(at::kDouble), db = b.detach().to(at::kDouble);
  double num = (da - db).abs().max().item<double>();
  if (num == 0) return 0;
  return num / std::max(db.abs().max().item<double>(), 1e-30);
}

std::vector<double> TrainUnsplit(torch::jit::Module& model, LossKind kind,
                                 const OptimizerOptions& optimizer, double clip_grad_norm,
                                 const std::vector<c10::IValue>& inputs, const c10::IValue& target,
                                 int microbatches, int steps) {
  std::vector<at::Tensor> params;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : model.named_parameters(true)) {
    if (p.value.requires_grad() && seen.insert(p.value.unsafeGetTensorImpl()).second) params.push_back(p.value);
  }
  auto opt = std::move(*MakeOptimizer(optimizer, params));
  auto mb_in = *SplitIntoMicrobatches(inputs, microbatches);
  auto mb_tg = *SplitIntoMicrobatches({target}, microbatches);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    double total = 0;
    for (int mb = 0; mb < microbatches; ++mb) {
      c10::IValue out = model.forward(mb_in[mb]);
      at::Tensor l = *ComputeLoss(kind, model, out, mb_tg[mb][0]);
      total += l.item<double>();
      torch::autograd::backward({l / static_cast<double>(microbatches)});
    }
    if (clip_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, clip_grad_norm);
    opt->step();
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    losses.push_back(total / microbatches);
  }
  return losses;
}

double MaxRelativeDifference(const std::vector<torch::jit::Module>& stages, const torch::jit::Module& reference,
                             int* compared) {
  std::map<std::string, at::Tensor> want;
  for (const auto& p : reference.named_parameters(true)) want[p.name] = p.value;
  for (const auto& b : reference.named_buffers(true)) want[b.name] = b.value;
  double worst = 0;
  *compared = 0;
  for (const auto& stage : stages) {
    for (const auto& p : stage.named_parameters(true)) {
      auto it = want.find(p.name);
      if (it == want.end()) return 1e30;  // a name the model does not have: fail loudly
      worst = std::max(worst, RelDiff(p.value, it->second));
      ++*compared;
    }
    for (const auto& b : stage.named_buffers(true)) {
      auto it = want.find(b.name);
      if (it != want.end() && at::isFloatingType(b.value.scalar_type())) worst = std::max(worst, RelDiff(b.value, it->second));
    }
  }
  return worst;
}

}  // namespace pippy::stage::testing
