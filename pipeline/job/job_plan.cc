#include "pipeline/job/job_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/device.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::job {

int64_t VocabularyOf(const PipelinePlan& plan) {
  const TensorMeta& out = plan.output().example();
  return out.shape_size() > 0 ? out.shape(out.shape_size() - 1) : 0;
}

absl::Status ResolveGeneration(const PipelinePlan& plan, JobSpec* spec) {
  GenerationSpec* g = spec->mutable_serving()->mutable_generation();
  auto bad = [](absl::string_view field, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
  };
  const char* kContract =
      "a generation model's forward(idx: Long[B, L], input_pos: Long[B, L], slots: Long[B]) returns Float[B, L, "
      "vocab] logits and keeps each attention layer's keys and values in buffers [max_slots, heads, max_seq, "
      "head_dim] (docs/api.md#generation)";
  if (plan.inputs_size() != 3) {
    std::vector<std::string> names;
    for (const ModelValue& v : plan.inputs()) names.push_back(v.name());
    return bad("model", absl::StrCat("forward() takes ", plan.inputs_size(), " argument(s) (",
                                     absl::StrJoin(names, ", "), "); ", kContract));
  }
  const TensorMeta& out = plan.output().example();
  if (out.shape_size() != 3 || out.dtype().rfind("float", 0) != 0) {
    return bad("model", absl::StrCat("forward() returned ", plan.output().type(), " [", absl::StrJoin(out.shape(), ", "),
                                     "] on the example; ", kContract));
  }
  int64_t slots = 0, seq = 0;
  std::string first;
  for (const StagePlan& st : plan.stages()) {
    for (const ParameterInfo& p : st.parameters()) {
      if (!p.written()) continue;
      if (!p.is_buffer() || p.shape_size() != 4) {
        return bad("model", absl::StrCat("'", p.name(), "' (shape [", absl::StrJoin(p.shape(), ", "),
                                         "]) is written by forward() but is not a cache with a slot dimension: ",
                                         kContract));
      }
      if (first.empty() || p.shape(0) < slots) slots = p.shape(0);
      if (first.empty() || p.shape(2) < seq) seq = p.shape(2);
      if (first.empty()) first = p.name();
    }
  }
  if (first.empty()) {
    return bad("model", absl::StrCat("forward() writes no buffer: a model without a KV cache cannot decode one "
                                     "token at a time; ", kContract));
  }
  if (g->max_slots() == 0) g->set_max_slots(static_cast<int>(slots));
  if (g->max_slots() > slots) {
    return bad("serving.generation.max_slots", absl::StrCat(g->max_slots(), " is more than the model's caches hold (",
                                                            slots, " slots, dim 0 of buffers such as '", first,
                                                            "'); script the model with more slots or ask for fewer"));
  }
  if (g->max_seq() == 0) g->set_max_seq(static_cast<int>(seq));
  if (g->max_seq() > seq) {
    return bad("serving.generation.max_seq", absl::StrCat(g->max_seq(), " is more than the model's caches hold (",
                                                          seq, " positions, dim 2 of buffers such as '", first, "')"));
  }
  if (spec->serving().max_batch() > g->max_slots()) spec->mutable_serving()->set_max_batch(g->max_slots());
  return absl::OkStatus();
}

absl::Status CheckPlan(const PipelinePlan& plan) {
  const int n = plan.stages_size();
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat("plan: ", parts...)); };
  if (n < 1) return bad("no stages");
  for (int s = 0; s < n; ++s) {
    const StagePlan& sp = plan.stages(s);
    if (sp.index() != s) return bad("stages[", s, "].index is ", sp.index(), "; stage k has index k");
    if (sp.is_last() != (s == n - 1)) {
      return bad("stages[", s, "].is_last is ", sp.is_last() ? "true" : "false", "; only the last stage is");
    }
    for (int i = 0; i < sp.inputs_size(); ++i) {
      const StageInput& si = sp.inputs(i);
      switch (si.source_case()) {
        case StageInput::kModelInput:
          if (si.model_input() < 0 || si.model_input() >= plan.inputs_size()) {
            return bad("stages[", s, "].inputs[", i, "].model_input ", si.model_input(), " is not one of the ",
                       plan.inputs_size(), " model inputs");
          }
          break;
        case StageInput::kSourceStage:
          if (si.source_stage() < 0 || si.source_stage() >= s) {
            return bad("stages[", s, "].inputs[", i, "].source_stage ", si.source_stage(),
                       " is not an earlier stage");
          }
          if (si.source_output() < 0 || si.source_output() >= plan.stages(si.source_stage()).outputs_size()) {
            return bad("stages[", s, "].inputs[", i, "].source_output ", si.source_output(), " is not one of stage ",
                       si.source_stage(), "'s ", plan.stages(si.source_stage()).outputs_size(), " outputs");
          }
          break;
        default: return bad("stages[", s, "].inputs[", i, "] names neither a model input nor a source stage");
      }
    }
    for (int o = 0; o < sp.outputs_size(); ++o) {
      for (int c : sp.outputs(o).consumers()) {
        if (c <= s || c >= n) return bad("stages[", s, "].outputs[", o, "] names consumer ", c, ", not a later stage");
      }
    }
    for (int p = 0; p < sp.parameters_size(); ++p) {
      const int g = sp.parameters(p).tie_group();
      if (g < -1 || g >= plan.tied_size()) {
        return bad("stages[", s, "].parameters[", p, "].tie_group ", g, " is not one of the ", plan.tied_size(),
                   " tied groups (or -1)");
      }
    }
  }
  for (int g = 0; g < plan.tied_size(); ++g) {
    const TiedParameter& tp = plan.tied(g);
    if (tp.stages_size() == 0) return bad("tied[", g, "] has no stages");
    for (int s : tp.stages()) {
      if (s < 0 || s >= n) return bad("tied[", g, "] names stage ", s, " of ", n);
    }
  }
  return absl::OkStatus();
}

schedule::StageGraph StageGraphOf(const PipelinePlan& plan) {
  schedule::StageGraph g;
  g.consumers.resize(plan.stages_size());
  for (const StagePlan& sp : plan.stages()) {
    for (const StageInput& si : sp.inputs()) {
      if (si.source_case() != StageInput::kSourceStage) continue;
      auto& c = g.consumers[si.source_stage()];
      if (std::find(c.begin(), c.end(), sp.index()) == c.end()) c.push_back(sp.index());
    }
  }
  for (auto& c : g.consumers) std::sort(c.begin(), c.end());
  return g;
}

absl::StatusOr<int> RanksFor(const JobSpec& spec, const PipelinePlan& plan) {
  const int stages = plan.stages_size();
  const int per_worker = std::max(spec.schedule().stages_per_worker(), 1);
  if (stages % per_worker != 0) {
    return absl::InvalidArgumentError(absl::StrCat("schedule.stages_per_worker: ", stages,
                                                   " stages do not divide into ", per_worker, " per worker"));
  }
  return stages / per_worker;
}

absl::StatusOr<schedule::Schedule> ScheduleFor(const JobSpec& spec, const PipelinePlan& plan) {
  absl::StatusOr<int> ranks = RanksFor(spec, plan);
  if (!ranks.ok()) return ranks.status();
  schedule::ScheduleOptions opts;
  opts.num_ranks = *ranks;
  opts.num_microbatches = spec.schedule().microbatches();
  opts.stages_per_rank = spec.schedule().stages_per_worker();
  opts.graph = StageGraphOf(plan);
  auto sched = schedule::MakeSchedule(spec.schedule().kind(), opts);
  if (!sched.ok()) return absl::InvalidArgumentError(absl::StrCat("schedule: ", sched.status().message()));
  absl::Status valid = schedule::Validate(*sched);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("schedule: ", valid.message()));
  return sched;
}

DataNeeds DataNeedsOf(const JobSpec& spec, const PipelinePlan& plan, const schedule::Schedule& schedule, int rank) {
  DataNeeds needs;
  for (const StagePlan& sp : plan.stages()) {
    if (schedule.stage_to_rank[sp.index()] != rank) continue;
    for (const StageInput& si : sp.inputs()) {
      if (si.source_case() == StageInput::kModelInput &&
          std::find(needs.inputs.begin(), needs.inputs.end(), si.model_input()) == needs.inputs.end()) {
        needs.inputs.push_back(si.model_input());
      }
    }
    if (sp.is_last() && spec.mode() == MODE_TRAIN) needs.targets = true;
  }
  std::sort(needs.inputs.begin(), needs.inputs.end());
  return needs;
}

int64_t StageBytesPerRank(const PipelinePlan& plan, const StagePlan& sp) {
  const int T = plan.tensor_parallel().size();
  if (T <= 1 || sp.parameters_size() == 0) return sp.param_bytes();
  int64_t bytes = 0;
  for (const ParameterInfo& pi : sp.parameters()) bytes += pi.has_tp_dim() ? pi.bytes() / T : pi.bytes();
  return bytes;
}

int64_t RankMemoryBytes(const JobSpec& spec, const PipelinePlan& plan, const std::vector<int>& stage_to_rank,
                        int rank) {
  int64_t copies = 1;  // the parameters (and buffers)
  if (spec.mode() == MODE_TRAIN) {
    copies += 1;  // gradients
    const OptimizerSpec& o = spec.optimizer();
    if (o.kind() == OPTIMIZER_ADAM || o.kind() == OPTIMIZER_ADAMW) copies += 2;
    if (o.kind() == OPTIMIZER_SGD && o.momentum() > 0) copies += 1;
  }
  int64_t bytes = 0;
  for (const StagePlan& sp : plan.stages()) {
    if (static_cast<size_t>(sp.index()) < stage_to_rank.size() && stage_to_rank[static_cast<size_t>(sp.index())] == rank) {
      bytes += StageBytesPerRank(plan, sp);
    }
  }
  return bytes * copies;
}

std::string TransportFor(const RankPlace& from, const RankPlace& to, bool use_nccl) {
  if (from.device.is_gpu() && to.device.is_gpu()) {
    return use_nccl && !(from.host == to.host && from.device == to.device) ? "nccl" : "ucx+staging";
  }
  return from.device.is_gpu() || to.device.is_gpu() ? "ucx+staging" : "ucx";
}

}  // namespace pippy::job
