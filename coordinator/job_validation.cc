#include "coordinator/job_validation.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/stage/training.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::coordinator {
namespace {

absl::Status Field(const std::string& field, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
}

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::StatusOr<ValidatedJob> ValidateJob(const JobSpec& in, const std::string& model_bytes, const std::string& data) {
  ValidatedJob out;
  JobSpec spec = in;
  if (spec.mode().empty()) spec.set_mode("train");
  if (spec.mode() != "train" && spec.mode() != "inference") return Bad("mode", "use train or inference");
  const bool train = spec.mode() == "train";
  if (!spec.has_schedule() || spec.schedule().name().empty()) return Bad("schedule.name", "missing (e.g. 1f1b)");
  auto kind = schedule::ParseScheduleKind(spec.schedule().name());
  if (!kind.ok()) return Field("schedule.name", kind.status());
  if (!train && *kind != schedule::ScheduleKind::kForwardOnly) {
    return Bad("schedule.name", "an inference job runs the inference schedule");
  }
  if (train && *kind == schedule::ScheduleKind::kForwardOnly) {
    return Bad("schedule.name", "inference runs forward only; use mode inference or a training schedule");
  }
  if (spec.schedule().microbatches() < 1) return Bad("schedule.microbatches", "must be at least 1");
  if (spec.steps() < 1) return Bad("steps", "must be at least 1");
  if (spec.batch_size() < 1) return Bad("batch_size", "must be at least 1");
  if (spec.batch_size() % spec.schedule().microbatches() != 0) {
    return Bad("batch_size", absl::StrCat(spec.batch_size(), " does not split into ", spec.schedule().microbatches(),
                                          " equal micro-batches"));
  }
  if (train) {
    if (spec.loss().empty()) return Bad("loss", "missing (mse, cross_entropy or model)");
    auto loss = stage::ParseLoss(spec.loss());
    if (!loss.ok()) return Field("loss", loss.status());
    if (!spec.has_optimizer() || spec.optimizer().name().empty()) return Bad("optimizer.name", "missing (sgd, adam, adamw)");
    const std::string& o = spec.optimizer().name();
    if (o != "sgd" && o != "adam" && o != "adamw") return Bad("optimizer.name", "use sgd, adam or adamw");
    if (spec.optimizer().lr() <= 0) return Bad("optimizer.lr", "must be > 0");
  }
  if (spec.split().stages() < 1 && spec.split().split_at().empty()) {
    return Bad("split", "give split.stages or split.split_at");
  }
  int per_worker = spec.schedule().stages_per_worker() > 0 ? spec.schedule().stages_per_worker()
                                                          : schedule::DefaultStagesPerRank(*kind);
  spec.mutable_schedule()->set_stages_per_worker(per_worker);
  if (model_bytes.empty()) return Bad("model", "empty: send the TorchScript file's bytes");
  auto model = partition::LoadModelFromBytes(model_bytes, "model");
  if (!model.ok()) return Field("model", model.status());
  torch::jit::setGraphExecutorOptimize(false);
  partition::SplitOptions so;
  so.num_stages = spec.split().stages();
  so.split_at.assign(spec.split().split_at().begin(), spec.split().split_at().end());
  if (!spec.split().balance().empty()) {
    auto b = partition::ParseBalance(spec.split().balance());
    if (!b.ok()) return Field("split.balance", b.status());
    so.balance = *b;
  }
  // Data: shapes must fit the model (one forward pass of the first batch, on a copy).
  if (data.empty()) {
    return Bad("data", "missing: send a torch.save({\"inputs\": ..., \"targets\": ...}) file or a synthetic spec");
  }
  auto ds = stage::DataSource::FromBytes(data, *model);
  if (!ds.ok()) return ds.status();
  if (train && !ds->has_targets()) return Bad("data", "training needs \"targets\" in the data file");
  if (!train && spec.steps() * spec.batch_size() > ds->num_samples() * 64) {
    return Bad("steps", "an inference job reads each sample at most a few times; lower steps or batch_size");
  }
  std::vector<c10::IValue> batch = ds->Inputs(0, spec.batch_size());
  torch::jit::Module copy = model->deepcopy();
  auto out_value = TorchCall("data: the inputs do not fit the model", [&] {
    torch::NoGradGuard g;
    return copy.forward(batch);
  });
  if (!out_value.ok()) return out_value.status();
  if (train) {
    auto loss = stage::ComputeLoss(*stage::ParseLoss(spec.loss()), copy, *out_value, ds->Target(0, spec.batch_size()));
    if (!loss.ok()) return Field("data: the targets do not fit the model's output", loss.status());
  }
  so.example_inputs = batch;
  auto pipe = partition::SplitModel(*model, so);
  if (!pipe.ok()) return Field("split", pipe.status());
  const int stages = pipe->plan.stages_size();
  if (stages % per_worker != 0) {
    return Bad("schedule.stages_per_worker", absl::StrCat(stages, " stages do not divide into ", per_worker,
                                                          " per worker"));
  }
  schedule::ScheduleOptions opts;
  opts.num_ranks = stages / per_worker;
  opts.num_microbatches = spec.schedule().microbatches();
  opts.stages_per_rank = per_worker;
  opts.graph = stage::StageGraphOf(pipe->plan);
  auto sched = schedule::MakeSchedule(*kind, opts);
  if (!sched.ok()) return Field("schedule", sched.status());
  out.spec = spec;
  out.plan = pipe->plan;
  out.ranks = opts.num_ranks;
  return out;
}


}  // namespace pippy::coordinator
