#include "pipeline/job/rank_job.h"

#include <algorithm>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/layout.h"
#include "pipeline/stage/lr_schedule.h"
#include "torch/serialize.h"

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
  if (spec.mode() == MODE_TRAIN) ro.learning_rates = stage::LearningRates(o, spec.steps());
  ro.timeout = timeout;
  if (spec.precision() == PRECISION_BF16) ro.autocast = at::kBFloat16;
  return ro;
}

void SeedProcessForRank(const JobSpec& spec, int rank, int replica, int ranks_per_replica) {
  torch::manual_seed(spec.seed() + static_cast<uint64_t>(replica) * static_cast<uint64_t>(ranks_per_replica) +
                     static_cast<uint64_t>(rank));
}

absl::StatusOr<std::unique_ptr<RankJob>> RankJob::Create(const JobSpec& spec, const PipelinePlan& plan,
                                                         const RankLayout& piece, int rank,
                                                         std::map<int, torch::jit::Module> stages,
                                                         transport::Transport* transport, absl::Duration timeout,
                                                         transport::ReplicaGroup* replicas, c10::Device device,
                                                         transport::ReplicaGroup* tensor_parallel) {
  const int want = std::max(1, spec.replicas());
  const int have = replicas != nullptr ? replicas->size() : 1;
  if (want != have) {
    return absl::InvalidArgumentError(absl::StrCat("the job has ", want, " replica(s) but rank ", rank, " was given a ",
                                                   "group of ", have));
  }
  const int tp_want = std::max(1, spec.tensor_parallel().size());
  const int tp_have = tensor_parallel != nullptr ? tensor_parallel->size() : 1;
  if (tp_want != tp_have || std::max(1, plan.tensor_parallel().size()) != tp_want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the job has ", tp_want, " tensor-parallel rank(s) per stage but rank ", rank, " was given a group of ",
        tp_have, " and a plan sharded ", std::max(1, plan.tensor_parallel().size()), " way(s)"));
  }
  std::unique_ptr<RankJob> job(new RankJob());
  job->spec_ = spec;
  job->rank_ = rank;
  job->replica_ = replicas != nullptr ? replicas->index() : 0;
  PIPPY_RETURN_IF_ERROR(CheckPlan(plan));
  PIPPY_ASSIGN_OR_RETURN(job->schedule_, RankSchedule(piece, rank, plan));
  stage::RuntimeOptions ro = RuntimeOptionsFor(spec, timeout);
  ro.replicas = replicas;
  ro.tensor_parallel = tensor_parallel;
  ro.device = device;
  job->device_ = device;
  if (device.is_cuda() && spec.precision() != PRECISION_BF16) stage::UseExactFloat32();
  PIPPY_ASSIGN_OR_RETURN(job->runtime_, stage::RankRuntime::Create(rank, plan, std::move(stages), job->schedule_,
                                                                   transport, ro));
  return job;
}

absl::StatusOr<stage::StepResult> RankJob::RunStep(int step, stage::BatchSource& data) {
  const int64_t batch = spec_.batch_size();
  const int replicas = schedule_.forward_only ? 1 : std::max(1, spec_.replicas());
  PIPPY_ASSIGN_OR_RETURN(stage::Batch b, data.Read(step, batch, schedule_.forward_only ? 0 : replica_, replicas));
  if (schedule_.forward_only) return runtime_->InferenceStep(step, b.inputs);
  return runtime_->TrainStep(step, b.inputs, b.target);
}

absl::StatusOr<stage::StepResult> RankJob::EvalStep(int eval_step, int64_t batch_index, stage::BatchSource* data) {
  if (schedule_.forward_only) return absl::FailedPreconditionError("an inference job does not evaluate");
  stage::Batch b;
  if (data != nullptr) {
    PIPPY_ASSIGN_OR_RETURN(b, data->Read(batch_index, spec_.batch_size(), replica_, std::max(1, spec_.replicas())));
  }
  return runtime_->EvalStep(eval_step, b.inputs, b.target);
}

}  // namespace pippy::job

namespace pippy::job {

absl::StatusOr<std::string> RankJob::SaveState() {
  return TorchCall("saving the rank's training state", [&]() -> absl::StatusOr<std::string> {
    torch::serialize::OutputArchive archive;
    archive.write("pippy_rank", torch::tensor(static_cast<int64_t>(rank_)));
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the process's generator
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      archive.write("rng_state", gen.get_state());
    }
    if (torch::optim::Optimizer* opt = runtime_->optimizer()) {
      torch::serialize::OutputArchive optimizer;
      opt->save(optimizer);
      archive.write("optimizer", optimizer);
    }
    std::ostringstream out;
    archive.save_to(out);
    return std::move(out).str();
  }, absl::StatusCode::kInternal);
}

absl::Status RankJob::RestoreState(absl::string_view bytes) {
  return TorchCall("restoring the rank's training state", [&]() -> absl::Status {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size(), device_);
    at::Tensor rank;
    archive.read("pippy_rank", rank);
    if (rank.item<int64_t>() != rank_) {
      return absl::DataLossError(absl::StrCat("the checkpoint's training state is rank ", rank.item<int64_t>(),
                                              "'s, not rank ", rank_, "'s"));
    }
    at::Tensor rng;
    archive.read("rng_state", rng);
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
    if (torch::optim::Optimizer* opt = runtime_->optimizer()) {
      torch::serialize::InputArchive optimizer;
      if (!archive.try_read("optimizer", optimizer)) {
        return absl::DataLossError("the checkpoint's training state has no optimizer state");
      }
      opt->load(optimizer);
    }
    return absl::OkStatus();
  }, absl::StatusCode::kDataLoss);
}

}  // namespace pippy::job
