#include "pipeline/partition/partition.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "pipeline/partition/cost_model.h"
#include "pipeline/partition/cut_selection.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/partition/plan_builder.h"

namespace pippy::partition {

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
  if (!options.cuts.empty() || options.cuts_chosen) {
    plan.set_split_method("auto-plan");
    for (size_t i = 0; i < options.cuts.size(); ++i) {
      const int c = options.cuts[i];
      if (!mg->IsLegalCut(c) || (i > 0 && c <= options.cuts[i - 1])) {
        return absl::InvalidArgumentError(absl::StrCat("cut at op ", c, " is not a legal cut of this model (",
                                                       mg->num_ops(), " ops): was the plan made for another model?"));
      }
    }
    cuts = options.cuts;
  } else if (!options.split_at.empty()) {
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

}  // namespace pippy::partition
