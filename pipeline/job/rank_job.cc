#include "pipeline/job/rank_job.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "pipeline/job/job_plan.h"

namespace pippy::job {

stage::RuntimeOptions RuntimeOptionsFor(const JobSpec& spec, absl::Duration timeout) {
  stage::RuntimeOptions ro;
  ro.loss = spec.loss();
  const OptimizerSpec& o = spec.optimizer();
  ro.optimizer.kind = o.kind();
  ro.optimizer.lr = o.lr();
  ro.optimizer.momentum = o.momentum();
  ro.optimizer.weight_decay = o.weight_decay();
  if (o.has_beta1()) ro.optimizer.beta1 = o.beta1();
  if (o.has_beta2()) ro.optimizer.beta2 = o.beta2();
  if (o.has_eps()) ro.optimizer.eps = o.eps();
  ro.clip_grad_norm = o.clip_grad_norm();
  ro.timeout = timeout;
  return ro;
}

void SeedProcessForRank(const JobSpec& spec, int rank) {
  torch::manual_seed(spec.seed() + static_cast<uint64_t>(rank));
}

absl::StatusOr<std::unique_ptr<RankJob>> RankJob::Create(const JobSpec& spec, const PipelinePlan& plan, int rank,
                                                         std::map<int, torch::jit::Module> stages,
                                                         transport::Transport* transport, absl::Duration timeout) {
  std::unique_ptr<RankJob> job(new RankJob());
  job->spec_ = spec;
  job->rank_ = rank;
  PIPPY_ASSIGN_OR_RETURN(job->schedule_, ScheduleFor(spec, plan));
  PIPPY_ASSIGN_OR_RETURN(job->runtime_, stage::RankRuntime::Create(rank, plan, std::move(stages), job->schedule_,
                                                                   transport, RuntimeOptionsFor(spec, timeout)));
  return job;
}

absl::StatusOr<stage::StepResult> RankJob::RunStep(int step, const stage::DataSource& data) {
  const int64_t batch = spec_.batch_size();
  if (schedule_.forward_only) return runtime_->InferenceStep(step, data.Inputs(step, batch));
  return runtime_->TrainStep(step, data.Inputs(step, batch), data.Target(step, batch));
}

}  // namespace pippy::job
