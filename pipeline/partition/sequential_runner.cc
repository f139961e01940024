#include "pipeline/partition/sequential_runner.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "torch/csrc/autograd/autograd.h"

namespace pippy::partition {

std::vector<at::Tensor> FlattenTensors(const c10::IValue& value) {
  std::vector<at::Tensor> out;
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& e : value.toTupleRef().elements()) {
      auto inner = FlattenTensors(e);
      out.insert(out.end(), inner.begin(), inner.end());
    }
  } else if (value.isList()) {
    for (const auto& e : value.toListRef()) {
      auto inner = FlattenTensors(e);
      out.insert(out.end(), inner.begin(), inner.end());
    }
  }
  return out;
}

absl::StatusOr<c10::IValue> SequentialRunner::Forward(const std::vector<c10::IValue>& inputs) {
  const PipelinePlan& plan = pipe_->plan;
  if (static_cast<int>(inputs.size()) != plan.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", plan.inputs_size(), " inputs, got ",
                                                   inputs.size()));
  }
  return TorchCall("running stages in sequence", [&]() -> c10::IValue {
    const int k = plan.stages_size();
    stage_inputs_.assign(k, {});
    stage_outputs_.assign(k, {});
    for (int s = 0; s < k; ++s) {
      const StagePlan& sp = plan.stages(s);
      std::vector<c10::IValue>& args = stage_inputs_[s];
      for (const StageInput& si : sp.inputs()) {
        if (si.source_case() == StageInput::kModelInput) {
          args.push_back(inputs[si.model_input()]);
          continue;
        }
        c10::IValue v = stage_outputs_[si.source_stage()][si.source_output()];
        if (v.isTensor()) {
          at::Tensor t = v.toTensor().detach();
          if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
          v = t;
        }
        args.push_back(v);
      }
      torch::jit::Module stage = pipe_->stages[s];  // a handle: same object
      c10::IValue out = stage.forward(args);
      if (sp.is_last()) {
        output_ = out;
      } else {
        stage_outputs_[s] = out.toTupleRef().elements().vec();
      }
    }
    return output_;
  });
}

absl::Status SequentialRunner::Backward(const at::Tensor& loss) {
  const PipelinePlan& plan = pipe_->plan;
  return TorchCall("backward through stages", [&] {
    torch::autograd::backward({loss});
    for (int s = plan.stages_size() - 2; s >= 0; --s) {
      const StagePlan& sp = plan.stages(s);
      std::vector<at::Tensor> outs, grads;
      for (int j = 0; j < sp.outputs_size(); ++j) {
        const c10::IValue& v = stage_outputs_[s][j];
        if (!v.isTensor() || !v.toTensor().requires_grad()) continue;
        at::Tensor grad;
        for (int c : sp.outputs(j).consumers()) {
          const StagePlan& cp = plan.stages(c);
          for (int i = 0; i < cp.inputs_size(); ++i) {
            const StageInput& si = cp.inputs(i);
            if (si.source_case() != StageInput::kSourceStage || si.source_stage() != s ||
                si.source_output() != j) {
              continue;
            }
            at::Tensor g = stage_inputs_[c][i].toTensor().grad();
            if (g.defined()) grad = grad.defined() ? grad + g : g;
          }
        }
        if (grad.defined()) {
          outs.push_back(v.toTensor());
          grads.push_back(grad);
        }
      }
      if (!outs.empty()) torch::autograd::backward(outs, grads);
    }
  });
}

std::map<std::string, at::Tensor> SequentialRunner::Gradients() const {
  std::map<std::string, at::Tensor> by_group;  // tie group canonical -> summed grad
  std::map<std::string, at::Tensor> out;
  const PipelinePlan& plan = pipe_->plan;
  for (int s = 0; s < plan.stages_size(); ++s) {
    std::map<std::string, at::Tensor> params;
    for (const auto& p : pipe_->stages[s].named_parameters(true)) params[p.name] = p.value;
    for (const ParameterInfo& pi : plan.stages(s).parameters()) {
      auto it = params.find(pi.name());
      if (it == params.end() || !it->second.grad().defined()) continue;
      std::string key = pi.tie_group() >= 0 ? plan.tied(pi.tie_group()).canonical() : pi.name();
      at::Tensor g = it->second.grad();
      by_group[key] = by_group.count(key) ? by_group[key] + g : g.clone();
      out[pi.name()] = by_group[key];
      for (const std::string& a : pi.aliases()) out[a] = by_group[key];
    }
  }
  // Re-point every name of a tie group at the final sum.
  for (const TiedParameter& tp : plan.tied()) {
    for (const std::string& n : tp.names()) out[n] = by_group[tp.canonical()];
  }
  return out;
}

std::map<std::string, at::Tensor> SequentialRunner::NamedTensors() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& stage : pipe_->stages) {
    for (const auto& p : stage.named_parameters(true)) out.emplace(p.name, p.value);
    for (const auto& b : stage.named_buffers(true)) out.emplace(b.name, b.value);
  }
  return out;
}

}  // namespace pippy::partition
