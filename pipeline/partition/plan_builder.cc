#include "pipeline/partition/plan_builder.h"

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/cut_selection.h"
#include "pipeline/partition/forward_probe.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/stage_builder.h"

namespace pippy::partition {
namespace {

using torch::jit::Value;

void FillMeta(const at::Tensor& t, TensorMeta* meta) {
  meta->set_dtype(torchio::DtypeName(t.scalar_type()));
  for (int64_t d : t.sizes()) meta->add_shape(d);
  meta->set_bytes(static_cast<int64_t>(t.numel() * t.element_size()));
}

// Stage definitions (inputs, outputs, consumers) for the given cuts.
struct StageGraphs {
  std::vector<StageDefinition> defs;
  // For every value crossing a stage boundary: producing stage and output index.
  std::unordered_map<Value*, std::pair<int, int>> produced;
  std::unordered_map<Value*, std::vector<int>> consumers;
};

StageGraphs DefineStages(const ModelGraph& mg, const std::vector<int>& cuts) {
  StageGraphs sg;
  std::vector<int> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(mg.num_ops());
  const int k = static_cast<int>(bounds.size()) - 1;
  std::vector<int> stage_of_op(mg.num_ops() + 1, k - 1);
  for (int s = 0; s < k; ++s) {
    for (int i = bounds[s]; i < bounds[s + 1]; ++i) stage_of_op[i] = s;
  }
  sg.defs.resize(k);
  for (int s = 0; s < k; ++s) {
    sg.defs[s].index = s;
    sg.defs[s].begin = bounds[s];
    sg.defs[s].end = bounds[s + 1];
    sg.defs[s].is_last = s == k - 1;
  }
  for (const ModelGraph::ValueInfo& vi : mg.values()) {
    int def_stage = vi.def < 0 ? -1 : stage_of_op[vi.def];
    std::vector<int> users;
    for (const torch::jit::Use& use : vi.value->uses()) {
      int op = mg.OpIndexOf(use.user);
      if (op < 0) continue;
      int s = stage_of_op[op];
      if (s != def_stage && std::find(users.begin(), users.end(), s) == users.end()) users.push_back(s);
    }
    std::sort(users.begin(), users.end());
    if (users.empty()) continue;
    if (def_stage >= 0) {
      StageDefinition& producer = sg.defs[def_stage];
      sg.produced[vi.value] = {def_stage, static_cast<int>(producer.outputs.size())};
      producer.outputs.push_back(vi.value);
    }
    sg.consumers[vi.value] = users;
    for (int s : users) sg.defs[s].inputs.push_back(vi.value);
  }
  return sg;
}

}  // namespace

// Builds all stages for the cuts and fills the plan (without costs or example data).
absl::Status BuildPipe(const ModelGraph& mg, const std::vector<int>& cuts, bool share_tensors, Pipe* pipe) {
  StageGraphs sg = DefineStages(mg, cuts);
  for (StageDefinition& def : sg.defs) def.share_tensors = share_tensors;
  PipelinePlan& plan = pipe->plan;
  std::vector<std::vector<int>> tensor_stages(mg.tensors().size());
  for (const StageDefinition& def : sg.defs) {
    PIPPY_ASSIGN_OR_RETURN(BuiltStage built, BuildStage(mg, def));
    StagePlan* sp = plan.add_stages();
    sp->set_index(def.index);
    sp->set_first_node(def.begin);
    sp->set_num_nodes(def.end - def.begin);
    sp->set_first_module(mg.op_path(def.begin));
    sp->set_last_module(mg.op_path(def.end - 1));
    sp->set_is_last(def.is_last);
    for (Value* in : def.inputs) {
      StageInput* si = sp->add_inputs();
      si->set_name(in->debugName());
      si->set_type(in->type()->repr_str());
      auto it = sg.produced.find(in);
      if (it == sg.produced.end()) {
        si->set_model_input(static_cast<int>(in->offset()) - 1);
      } else {
        si->set_source_stage(it->second.first);
        si->set_source_output(it->second.second);
      }
    }
    for (Value* out : def.outputs) {
      StageOutput* so = sp->add_outputs();
      so->set_name(out->debugName());
      so->set_type(out->type()->repr_str());
      for (int c : sg.consumers[out]) so->add_consumers(c);
    }
    if (def.is_last) {
      StageOutput* so = sp->add_outputs();
      so->set_name("output");
      so->set_type(mg.graph().outputs()[0]->type()->repr_str());
    }
    for (const auto& [name, index] : built.tensors) {
      const ModelTensor& mt = mg.tensors()[index];
      ParameterInfo* pi = sp->add_parameters();
      pi->set_name(name);
      for (const std::string& alias : mt.names) {
        if (alias != name) pi->add_aliases(alias);
      }
      for (int64_t d : mt.tensor.sizes()) pi->add_shape(d);
      pi->set_dtype(torchio::DtypeName(mt.tensor.scalar_type()));
      pi->set_bytes(static_cast<int64_t>(mt.tensor.numel() * mt.tensor.element_size()));
      pi->set_is_buffer(!mt.is_parameter);
      pi->set_requires_grad(mt.is_parameter && mt.tensor.requires_grad());
      pi->set_tie_group(-1);
      pi->set_written(mt.written);
      if (mt.is_parameter) {
        sp->set_num_params(sp->num_params() + mt.tensor.numel());
        sp->set_param_bytes(sp->param_bytes() + pi->bytes());
      }
      tensor_stages[index].push_back(def.index);
    }
    pipe->stages.push_back(built.module);
  }
  // Tensors held by several stages (tied weights) form tie groups.
  for (size_t t = 0; t < mg.tensors().size(); ++t) {
    if (tensor_stages[t].size() < 2) continue;
    if (mg.tensors()[t].written) {
      // Each stage would get its own copy, and one stage's writes would never reach
      // the other's reads (a KV cache written by one stage and read by the next).
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer '", mg.tensors()[t].names[0], "' is modified in place by forward() and read by stages ",
          absl::StrJoin(tensor_stages[t], " and "), ": stages cannot share it; move the cut so that the "
          "module owning it and every op reading it stay in one stage"));
    }
    int group = plan.tied_size();
    TiedParameter* tp = plan.add_tied();
    tp->set_canonical(mg.tensors()[t].names[0]);
    for (const std::string& n : mg.tensors()[t].names) tp->add_names(n);
    for (int s : tensor_stages[t]) {
      tp->add_stages(s);
      for (ParameterInfo& pi : *plan.mutable_stages(s)->mutable_parameters()) {
        const auto& names = mg.tensors()[t].names;
        if (std::find(names.begin(), names.end(), pi.name()) != names.end()) {
          pi.set_tie_group(group);
        }
      }
    }
  }
  for (int c : cuts) {
    std::string name = CutName(mg, c);
    plan.add_split_points(name.empty() ? absl::StrCat("op:", c) : name);
  }
  return absl::OkStatus();
}

// Runs the stages in sequence on copies (so buffers of the result stay untouched) and
// records shapes and bytes of everything that flows. Returns per-stage forward times (µs).
absl::StatusOr<std::vector<double>> RunExample(Pipe* pipe, const std::vector<c10::IValue>& inputs,
                                              int repeats, const StageHooks& hooks, c10::IValue* output) {
  absl::Status hook_error;
  absl::StatusOr<std::vector<double>> ran = TorchCall("running the example input through the stages",
                   [&]() -> absl::StatusOr<std::vector<double>> {
    PipelinePlan& plan = pipe->plan;
    for (int i = 0; i < plan.inputs_size(); ++i) {
      if (inputs[i].isTensor()) FillMeta(inputs[i].toTensor(), plan.mutable_inputs(i)->mutable_example());
    }
    // The stages themselves run (no copies: a copy of every stage is a copy of the
    // model); what a forward may change, the buffers, is put back after each.
    std::vector<torch::jit::Module>& copies = pipe->stages;
    std::vector<double> times(copies.size(), 1e300);
    torch::NoGradGuard no_grad;
    for (int r = 0; r < repeats; ++r) {
      std::vector<std::vector<c10::IValue>> outs(copies.size());
      for (size_t s = 0; s < copies.size(); ++s) {
        StagePlan* sp = plan.mutable_stages(static_cast<int>(s));
        std::vector<c10::IValue> args;
        for (StageInput& si : *sp->mutable_inputs()) {
          c10::IValue v = si.source_case() == StageInput::kModelInput
                              ? inputs[si.model_input()]
                              : outs[si.source_stage()][si.source_output()];
          if (v.isTensor()) FillMeta(v.toTensor(), si.mutable_example());
          args.push_back(v);
        }
        if (hooks.before) hook_error = hooks.before(static_cast<int>(s), copies[s]);
        if (!hook_error.ok()) return hook_error;
        c10::IValue result;
        {
          BufferSnapshot restore(copies[s]);
          auto start = std::chrono::steady_clock::now();
          result = copies[s].forward(args);
          double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
          times[s] = std::min(times[s], us);
        }
        if (hooks.after) hook_error = hooks.after(static_cast<int>(s), copies[s]);
        if (!hook_error.ok()) return hook_error;
        if (sp->is_last()) {
          if (output != nullptr) *output = result;
          outs[s] = {result};
          if (result.isTensor()) FillMeta(result.toTensor(), sp->mutable_outputs(0)->mutable_example());
          if (result.isTensor()) FillMeta(result.toTensor(), plan.mutable_output()->mutable_example());
          continue;
        }
        outs[s] = result.toTupleRef().elements().vec();
        int64_t sent = 0;
        for (int j = 0; j < sp->outputs_size(); ++j) {
          StageOutput* so = sp->mutable_outputs(j);
          if (outs[s][j].isTensor()) {
            FillMeta(outs[s][j].toTensor(), so->mutable_example());
            sent += so->example().bytes() * so->consumers_size();
          }
        }
        sp->set_activation_bytes_sent(sent);
      }
    }
    return times;
  });
  // A hook's error as the hook said it, not as a LibTorch failure of the run.
  if (!hook_error.ok()) return hook_error;
  return ran;
}

}  // namespace pippy::partition
