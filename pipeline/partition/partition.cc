#include "pipeline/partition/partition.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/partition/cut_selection.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/partition/stage_builder.h"
#include "torch/csrc/jit/api/function_impl.h"

namespace pippy::partition {
namespace {

using torch::jit::Node;
using torch::jit::Value;

// The buffers of a module (batch-norm statistics and the like), copied at
// construction and written back at destruction: a forward pass run only to measure
// leaves the module as it was, without a copy of its parameters.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(const torch::jit::Module& module) {
    for (const auto& b : module.named_buffers(/*recurse=*/true)) {
      if (b.value.defined()) saved_.emplace_back(b.value, b.value.clone());
    }
  }
  BufferSnapshot(BufferSnapshot&&) = default;
  BufferSnapshot& operator=(BufferSnapshot&&) = default;
  ~BufferSnapshot() {
    torch::NoGradGuard no_grad;
    for (auto& [live, copy] : saved_) {
      if (live.defined()) live.copy_(copy);
    }
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;
};

void FillMeta(const at::Tensor& t, TensorMeta* meta) {
  meta->set_dtype(DtypeName(t.scalar_type()));
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

// Parameter bytes first read by each op (each tensor counted once).
std::vector<double> ParamCosts(const ModelGraph& mg) {
  std::vector<double> cost(mg.num_ops(), 0.0);
  std::vector<bool> seen(mg.tensors().size(), false);
  for (int i = 0; i < mg.num_ops(); ++i) {
    for (const std::string& p : mg.tensor_reads(i)) {
      int t = mg.TensorIndexOf(p);
      if (seen[t] || !mg.tensors()[t].is_parameter) continue;
      seen[t] = true;
      const at::Tensor& tensor = mg.tensors()[t].tensor;
      cost[i] += static_cast<double>(tensor.numel() * tensor.element_size());
    }
  }
  return cost;
}

// Runs the inlined forward once on a copy of the model and returns every top-level
// op output (by op index, output index).
absl::StatusOr<std::vector<std::vector<c10::IValue>>> CaptureOpOutputs(
    const ModelGraph& mg, const std::vector<c10::IValue>& inputs) {
  return TorchCall("running the example input through the model", [&]()
                       -> absl::StatusOr<std::vector<std::vector<c10::IValue>>> {
    auto graph = mg.graph().copy();
    // Graph::copy keeps node order: pair the ops of the copy with the original's.
    std::vector<Node*> copy_ops;
    {
      auto orig = mg.graph().nodes().begin();
      for (Node* n : graph->nodes()) {
        if (!mg.IsFree(*orig)) copy_ops.push_back(n);
        ++orig;
      }
    }
    std::vector<Value*> captured;
    for (Node* n : copy_ops) {
      for (Value* v : n->outputs()) captured.push_back(v);
    }
    torch::jit::WithInsertPoint guard(graph->return_node());
    Value* orig_out = graph->outputs()[0];
    graph->eraseOutput(0);
    std::vector<Value*> all = {orig_out};
    all.insert(all.end(), captured.begin(), captured.end());
    graph->registerOutput(graph->insertNode(graph->createTuple(all))->output());
    torch::jit::GraphFunction fn("pippy_capture", graph, nullptr);
    BufferSnapshot restore(mg.model());  // the model runs itself; its buffers are put back
    torch::jit::Stack stack;
    stack.push_back(mg.model()._ivalue());
    for (const auto& in : inputs) stack.push_back(in);
    torch::NoGradGuard no_grad;
    fn.run(stack);
    auto tuple = stack.back().toTuple();
    std::vector<std::vector<c10::IValue>> out(copy_ops.size());
    size_t k = 1;
    for (size_t i = 0; i < copy_ops.size(); ++i) {
      for (size_t j = 0; j < copy_ops[i]->outputs().size(); ++j) out[i].push_back(tuple->elements()[k++]);
    }
    return out;
  });
}

int64_t Numel(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().numel();
  int64_t n = 0;
  if (v.isTuple()) for (const auto& e : v.toTupleRef().elements()) n += Numel(e);
  if (v.isTensorList()) for (const at::Tensor& t : v.toTensorVector()) n += t.numel();
  return n;
}

// Estimated FLOPs of every op with the shapes of the example input: 2·MACs for matrix
// products and convolutions, a few per element for normalisations and softmax, one
// per output element otherwise.
absl::StatusOr<std::vector<double>> FlopCosts(const ModelGraph& mg,
                                              const std::vector<c10::IValue>& inputs) {
  PIPPY_ASSIGN_OR_RETURN(auto outputs, CaptureOpOutputs(mg, inputs));
  std::unordered_map<const Value*, at::Tensor> known;
  for (int i = 0; i < mg.num_ops(); ++i) {
    for (size_t j = 0; j < outputs[i].size(); ++j) {
      if (outputs[i][j].isTensor()) known[mg.op(i)->output(j)] = outputs[i][j].toTensor();
    }
  }
  for (size_t i = 1; i < mg.graph().inputs().size(); ++i) {
    if (inputs[i - 1].isTensor()) known[mg.graph().inputs()[i]] = inputs[i - 1].toTensor();
  }
  auto tensor_of = [&](const Value* v) -> const at::Tensor* {
    auto it = known.find(v);
    if (it != known.end()) return &it->second;
    if (v->node()->kind() == c10::prim::GetAttr) {
      auto path = AttributePath(v, mg.self());
      if (path) {
        int t = mg.TensorIndexOf(absl::StrJoin(*path, "."));
        if (t >= 0) return &mg.tensors()[t].tensor;
      }
    }
    return nullptr;
  };
  std::vector<double> cost(mg.num_ops(), 0.0);
  for (int i = 0; i < mg.num_ops(); ++i) {
    Node* n = mg.op(i);
    double out_numel = 0;
    for (const auto& o : outputs[i]) out_numel += static_cast<double>(Numel(o));
    const std::string kind = n->kind().toQualString();
    double flops = out_numel;
    const at::Tensor* a = n->inputs().size() > 0 ? tensor_of(n->input(0)) : nullptr;
    const at::Tensor* b = n->inputs().size() > 1 ? tensor_of(n->input(1)) : nullptr;
    if ((kind == "aten::linear") && b != nullptr && b->dim() == 2) {
      flops = 2.0 * out_numel * static_cast<double>(b->size(1));
    } else if ((kind == "aten::matmul" || kind == "aten::mm" || kind == "aten::bmm") && a && a->dim() >= 1) {
      flops = 2.0 * out_numel * static_cast<double>(a->size(-1));
    } else if (kind == "aten::addmm" && b && b->dim() == 2) {
      flops = 2.0 * out_numel * static_cast<double>(b->size(1));
    } else if ((kind == "aten::conv1d" || kind == "aten::conv2d" || kind == "aten::conv3d" ||
                kind == "aten::_convolution" || kind == "aten::convolution") && b && b->dim() >= 3) {
      flops = 2.0 * out_numel * static_cast<double>(b->numel() / b->size(0));
    } else if ((kind == "aten::conv_transpose1d" || kind == "aten::conv_transpose2d" ||
                kind == "aten::conv_transpose3d") && a && b && b->dim() >= 3) {
      flops = 2.0 * static_cast<double>(a->numel()) * static_cast<double>(b->numel() / b->size(0));
    } else if (kind == "aten::layer_norm" || kind == "aten::batch_norm" || kind == "aten::group_norm" ||
               kind == "aten::softmax" || kind == "aten::log_softmax" || kind == "aten::gelu") {
      flops = 5.0 * out_numel;
    } else if (!n->blocks().empty()) {
      // Control flow: count what its body computes once per output element.
      flops = std::max(out_numel, 1.0) * 2.0;
    }
    cost[i] = flops;
  }
  return cost;
}

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
      pi->set_dtype(DtypeName(mt.tensor.scalar_type()));
      pi->set_bytes(static_cast<int64_t>(mt.tensor.numel() * mt.tensor.element_size()));
      pi->set_is_buffer(!mt.is_parameter);
      pi->set_requires_grad(mt.is_parameter && mt.tensor.requires_grad());
      pi->set_tie_group(-1);
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
                                              int repeats) {
  return TorchCall("running the example input through the stages",
                   [&]() -> absl::StatusOr<std::vector<double>> {
    PipelinePlan& plan = pipe->plan;
    for (int i = 0; i < plan.inputs_size(); ++i) {
      if (inputs[i].isTensor()) FillMeta(inputs[i].toTensor(), plan.mutable_inputs(i)->mutable_example());
    }
    // The stages themselves run (no copies: a copy of every stage is a copy of the
    // model); what a forward may change, the buffers, is put back afterwards.
    std::vector<torch::jit::Module>& copies = pipe->stages;
    std::vector<BufferSnapshot> restore;
    for (const auto& s : copies) restore.emplace_back(s);
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
        auto start = std::chrono::steady_clock::now();
        c10::IValue result = copies[s].forward(args);
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        times[s] = std::min(times[s], us);
        if (sp->is_last()) {
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
}

}  // namespace

absl::StatusOr<c10::IValue> RunForwardOnce(const torch::jit::Module& model, const std::vector<c10::IValue>& inputs) {
  BufferSnapshot restore(model);
  return TorchCall("forward", [&] {
    torch::NoGradGuard no_grad;
    torch::jit::Module m = model;
    return m.forward(inputs);
  });
}

absl::StatusOr<Pipe> SplitModel(const torch::jit::Module& model, const SplitOptions& options) {
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<ModelGraph> mg, ModelGraph::Build(model));
  const bool have_example = !options.example_inputs.empty();
  const size_t n_args = mg->graph().inputs().size() - 1;
  if (have_example && options.example_inputs.size() != n_args) {
    return absl::InvalidArgumentError(absl::StrCat("the example input has ", options.example_inputs.size(),
                                                   " value(s) but forward() takes ", n_args));
  }
  if (mg->num_ops() == 0) {
    return absl::InvalidArgumentError("forward() computes nothing: there is nothing to split");
  }
  Pipe pipe;
  PipelinePlan& plan = pipe.plan;
  plan.set_model(options.model_name.empty() ? model.type()->name()->qualifiedName() : options.model_name);
  plan.set_num_nodes(mg->num_ops());
  plan.set_num_legal_cuts(static_cast<int>(mg->legal_cuts().size()));
  for (size_t i = 1; i < mg->graph().inputs().size(); ++i) {
    ModelValue* mv = plan.add_inputs();
    mv->set_name(mg->graph().inputs()[i]->debugName());
    mv->set_type(mg->graph().inputs()[i]->type()->repr_str());
  }
  plan.mutable_output()->set_name("output");
  plan.mutable_output()->set_type(mg->graph().outputs()[0]->type()->repr_str());

  std::vector<int> cuts;
  std::vector<double> op_costs = ParamCosts(*mg);
  plan.set_cost_unit("bytes");
  if (!options.split_at.empty()) {
    plan.set_split_method("split-at");
    PIPPY_ASSIGN_OR_RETURN(cuts, CutsFromSplitAt(*mg, options.split_at));
    if (options.num_stages > 0 && options.num_stages != static_cast<int>(cuts.size()) + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--split-at gives ", cuts.size() + 1, " stages but --stages ", options.num_stages,
          " was asked; give one of them"));
    }
  } else if (!mg->marker_cuts().empty() &&
             (options.num_stages == 0 ||
              options.num_stages == static_cast<int>(mg->marker_cuts().size()) + 1)) {
    plan.set_split_method("markers");
    PIPPY_ASSIGN_OR_RETURN(cuts, CutsFromMarkers(*mg));
  } else {
    plan.set_split_method("auto");
    const Balance balance = options.balance == BALANCE_UNSPECIFIED ? BALANCE_PARAMS : options.balance;
    plan.set_balance(balance);
    int k = std::max(options.num_stages, 1);
    std::vector<int> candidates;
    if (balance != BALANCE_PARAMS && !have_example) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--balance ", balance == BALANCE_FLOPS ? "flops" : "time",
          " needs --example-input FILE (costs depend on the input's shapes); or use --balance params"));
    }
    if (balance == BALANCE_FLOPS) {
      PIPPY_ASSIGN_OR_RETURN(op_costs, FlopCosts(*mg, options.example_inputs));
      plan.set_cost_unit("flop");
    } else if (balance == BALANCE_TIME) {
      // Profile spans between (at most 64) evenly spread legal cuts as stages, then
      // balance the measured times over those spans.
      const auto& legal = mg->legal_cuts();
      const size_t want = std::min<size_t>(legal.size(), 63);
      for (size_t i = 0; i < want; ++i) candidates.push_back(legal[(i * legal.size()) / want]);
      candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
      Pipe probe;
      *probe.plan.mutable_inputs() = plan.inputs();
      PIPPY_RETURN_IF_ERROR(BuildPipe(*mg, candidates, /*share_tensors=*/true, &probe));
      PIPPY_ASSIGN_OR_RETURN(std::vector<double> times, RunExample(&probe, options.example_inputs, 3));
      op_costs.assign(mg->num_ops(), 0.0);
      for (const StagePlan& sp : probe.plan.stages()) op_costs[sp.first_node()] = times[sp.index()];
      plan.set_cost_unit("us");
    }
    PIPPY_ASSIGN_OR_RETURN(cuts, BalancedCuts(*mg, k, op_costs, candidates));
  }
  PIPPY_RETURN_IF_ERROR(BuildPipe(*mg, cuts, options.share_tensors, &pipe));
  // Stage costs in the balance's unit.
  for (StagePlan& sp : *plan.mutable_stages()) {
    double c = 0;
    for (int i = sp.first_node(); i < sp.first_node() + sp.num_nodes(); ++i) c += op_costs[i];
    sp.set_cost(c);
  }
  if (have_example) {
    PIPPY_RETURN_IF_ERROR(RunExample(&pipe, options.example_inputs, 1).status());
  }
  return pipe;
}

absl::StatusOr<std::vector<CutPoint>> ListLegalCuts(const torch::jit::Module& model) {
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<ModelGraph> mg, ModelGraph::Build(model));
  std::vector<CutPoint> out;
  for (int c : mg->legal_cuts()) {
    out.push_back({c, CutName(*mg, c), mg->op_path(c - 1), mg->op_path(c)});
  }
  return out;
}

std::string PlanToJson(const PipelinePlan& plan) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(plan, &json, opts);
  return json;
}

absl::Status WritePipe(const Pipe& pipe, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create output folder '", dir, "': ", ec.message()));
  }
  for (size_t s = 0; s < pipe.stages.size(); ++s) {
    std::string path = absl::StrCat(dir, "/stage_", s, ".pt");
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("writing '", path, "'"),
                                    [&] { pipe.stages[s].save(path); }, absl::StatusCode::kInternal));
  }
  std::string path = absl::StrCat(dir, "/plan.json");
  std::ofstream out(path);
  out << PlanToJson(pipe.plan);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

}  // namespace pippy::partition
