#include "pipeline/job/job_spec.h"

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "proto/names.h"

namespace pippy::job {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::StatusOr<ScheduleKind> ParseSchedule(absl::string_view name) {
  return names::Parse<ScheduleKind>("schedule", name);
}
std::string ScheduleName(ScheduleKind kind) { return names::Name(kind); }
absl::StatusOr<LossKind> ParseLoss(absl::string_view name) { return names::Parse<LossKind>("loss", name); }
std::string LossName(LossKind loss) { return names::Name(loss); }
absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view name) {
  return names::Parse<OptimizerKind>("optimizer", name);
}
std::string OptimizerName(OptimizerKind optimizer) { return names::Name(optimizer); }
absl::StatusOr<LrScheduleKind> ParseLrSchedule(absl::string_view name) {
  return names::Parse<LrScheduleKind>("lr schedule", name);
}
std::string LrScheduleName(LrScheduleKind kind) { return names::Name(kind); }
absl::StatusOr<TokenDtype> ParseTokenDtype(absl::string_view name) {
  return names::Parse<TokenDtype>("token dtype", name);
}
absl::StatusOr<Precision> ParsePrecision(absl::string_view name) { return names::Parse<Precision>("--dtype", name); }
std::string PrecisionName(Precision precision) {
  return names::Name(precision == PRECISION_UNSPECIFIED ? PRECISION_FP32 : precision);
}
absl::StatusOr<Balance> ParseBalance(absl::string_view name) { return names::Parse<Balance>("--balance", name); }
std::string BalanceName(Balance balance) {
  return names::Name(balance == BALANCE_UNSPECIFIED ? BALANCE_PARAMS : balance);
}
std::string ModeName(Mode mode) { return names::Name(mode); }

double DefaultWeightDecay(OptimizerKind optimizer) { return optimizer == OPTIMIZER_ADAMW ? 0.01 : 0.0; }

bool CheckpointAfter(const JobSpec& spec, int steps_done) {
  const int every = spec.fault_tolerance().checkpoint_every();
  return spec.mode() == MODE_TRAIN && every > 0 && steps_done > 0 && steps_done < spec.steps() &&
         steps_done % every == 0;
}

bool EvalAfter(const JobSpec& spec, int steps_done) {
  if (!spec.has_eval() || spec.eval().dataset().path().empty() || spec.mode() != MODE_TRAIN) return false;
  const int every = spec.eval().every();
  return steps_done == spec.steps() || (every > 0 && steps_done > 0 && steps_done % every == 0);
}

bool KeepsFinalState(const JobSpec& spec) {
  return spec.mode() == MODE_TRAIN && !spec.has_serving() && spec.fault_tolerance().checkpoint_every() > 0 &&
         spec.steps() > 0;
}

namespace {

// A serving job's spec: the serving fields, and the rest as serving fixes them.
absl::Status CheckServing(JobSpec* spec) {
  ServingSpec* sv = spec->mutable_serving();
  if (sv->max_batch() < 0) return Bad("serving.max_batch", "must not be negative (0: the default, 32)");
  if (sv->max_batch() == 0) sv->set_max_batch(kDefaultServingMaxBatch);
  if (sv->max_batch() > kMaxServingBatch) {
    return Bad("serving.max_batch", absl::StrCat("at most ", kMaxServingBatch, " rows per micro-batch"));
  }
  if (!sv->has_max_delay_ms()) sv->set_max_delay_ms(kDefaultServingMaxDelayMs);
  if (sv->max_delay_ms() < 0 || sv->max_delay_ms() > 60000) {
    return Bad("serving.max_delay_ms", "must be in [0, 60000] (0: send what is queued at once)");
  }
  if (sv->max_inflight() < 0 || sv->max_inflight() > 1024) {
    return Bad("serving.max_inflight", "must be in [0, 1024] (0: stages + 1)");
  }
  ScheduleSpec* sched = spec->mutable_schedule();
  if (sched->kind() == SCHEDULE_KIND_UNSPECIFIED) sched->set_kind(SCHEDULE_INFERENCE);
  if (sched->kind() != SCHEDULE_INFERENCE) {
    return Bad("schedule.kind", "a serving job runs the inference schedule (forward only); leave it unset");
  }
  if (spec->mode() == MODE_TRAIN) return Bad("mode", "a serving job runs inference");
  if (sched->microbatches() > 1) {
    return Bad("schedule.microbatches", "a serving job's micro-batches are its batches (serving.max_batch); leave it unset");
  }
  sched->set_microbatches(1);
  if (spec->steps() != 0) return Bad("steps", "a serving job runs until it is cancelled; leave steps unset");
  if (spec->replicas() > 1) return Bad("replicas", "a serving job runs one pipeline (serve it again for more)");
  if (spec->batch_size() != 0 && spec->batch_size() != sv->max_batch()) {
    return Bad("batch_size", "a serving job's batch is serving.max_batch; leave batch_size unset");
  }
  spec->set_batch_size(sv->max_batch());
  if (sv->max_queued() < 0 || sv->max_queued() > 1000000) {
    return Bad("serving.max_queued", "must be in [0, 1000000] (0: 4096)");
  }
  if (sv->max_queued() == 0) sv->set_max_queued(kDefaultServingMaxQueued);
  if (sv->has_generation()) {
    GenerationSpec* g = sv->mutable_generation();
    if (g->max_slots() < 0 || g->max_slots() > 65536) {
      return Bad("serving.generation.max_slots", "must be in [0, 65536] (0: the caches' slot dimension)");
    }
    if (g->max_seq() < 0) return Bad("serving.generation.max_seq", "must not be negative (0: the caches' length)");
    if (g->prefill_chunk() < 0 || g->prefill_chunk() > 65536) {
      return Bad("serving.generation.prefill_chunk", "must be in [0, 65536] (0: 64)");
    }
    if (g->prefill_chunk() == 0) g->set_prefill_chunk(kDefaultPrefillChunk);
    if (spec->tensor_parallel().size() > 1) {
      return Bad("tensor_parallel", "generation with tensor parallelism is not supported yet; serve it without "
                                    "--tensor-parallel");
    }
    if (spec->precision() == PRECISION_BF16) {
      // Autocast would write bf16 keys and values into the fp32 caches.
      return Bad("precision", "generation in bf16 is not supported yet (the caches are the model's fp32 buffers); "
                              "serve it in fp32, or script the model in bf16 (.to(torch.bfloat16)) and serve that");
    }
  }
  return absl::OkStatus();
}

// The data's fields: one source; a dataset's (the coordinator indexes it, and says
// what is wrong with its files, when it prepares the job).
absl::Status CheckData(JobSpec* spec) {
  const DataSpec& data = spec->data();
  const DatasetSpec& ds = data.dataset();
  const bool dataset = !ds.path().empty();
  if (spec->epochs() < 0) return Bad("epochs", "must not be negative");
  if (spec->epochs() > 0 && spec->steps() > 0) return Bad("epochs", "give steps or epochs, not both");
  if (spec->epochs() > 0 && !dataset) return Bad("epochs", "epochs are passes over a dataset: give data.dataset");
  if (!dataset) {
    if (ds.seq_len() != 0 || ds.shuffle() || ds.token_dtype() != TOKEN_DTYPE_UNSPECIFIED) {
      return Bad("data.dataset", "seq_len, token_dtype and shuffle are a dataset's: give data.dataset.path");
    }
    return absl::OkStatus();
  }
  if (!data.file().empty() || !data.synthetic().empty()) {
    return Bad("data.dataset", "give a dataset, a data file or synthetic data, one of them");
  }
  if (spec->has_serving() || spec->mode() == MODE_INFERENCE || spec->schedule().kind() == SCHEDULE_INFERENCE) {
    return Bad("data.dataset", "datasets are for training jobs (an inference job reads a data file)");
  }
  if (ds.path()[0] != '/') {
    return Bad("data.dataset.path", absl::StrCat("'", ds.path(), "' is not absolute: the workers read it where they run"));
  }
  if (ds.seq_len() < 0) return Bad("data.dataset.seq_len", "must not be negative");
  if (!TokenDtype_IsValid(ds.token_dtype())) return Bad("data.dataset.token_dtype", "use uint16 or uint32");
  return absl::OkStatus();
}

// Evaluation's fields; the validation dataset's sequence length and token width are
// the training dataset's unless given.
absl::Status CheckEval(JobSpec* spec) {
  if (!spec->has_eval()) return absl::OkStatus();
  EvalSpec* ev = spec->mutable_eval();
  DatasetSpec* ds = ev->mutable_dataset();
  if (ds->path().empty()) {
    return Bad("eval.dataset.path", "evaluation needs a validation dataset (eval.every and eval.batches are its)");
  }
  if (spec->has_serving() || spec->mode() != MODE_TRAIN) return Bad("eval", "only a training job evaluates");
  if (ds->path()[0] != '/') {
    return Bad("eval.dataset.path", absl::StrCat("'", ds->path(), "' is not absolute: the workers read it where they run"));
  }
  if (ev->every() < 0) return Bad("eval.every", "must not be negative (0: after the last step only)");
  if (ev->batches() < 0) return Bad("eval.batches", "must not be negative (0: up to 100)");
  if (ev->batches() > 1000000) return Bad("eval.batches", "at most 1000000");
  const DatasetSpec& train = spec->data().dataset();
  if (ds->seq_len() == 0) ds->set_seq_len(train.seq_len());
  if (ds->token_dtype() == TOKEN_DTYPE_UNSPECIFIED) ds->set_token_dtype(train.token_dtype());
  if (ds->seq_len() < 0) return Bad("eval.dataset.seq_len", "must not be negative");
  if (!TokenDtype_IsValid(ds->token_dtype())) return Bad("eval.dataset.token_dtype", "use uint16 or uint32");
  ds->set_shuffle(false);
  return absl::OkStatus();
}

// A spec with auto_plan: what it leaves to pippy is checked as far as it can be before
// the choice; the fields still to be chosen stay unset (a chosen value is checked as
// any value would be).
absl::Status CheckAutoSpec(JobSpec* spec) {
  const AutoPlanSpec& a = spec->auto_plan();
  const ScheduleSpec& sc = spec->schedule();
  if (spec->has_serving()) {
    return Bad("auto_plan", "a serving job's plan is not chosen automatically: give --stages (its schedule is "
                            "the inference one, one micro-batch per request batch)");
  }
  if (spec->tensor_parallel().size() > 1) {
    return Bad("auto_plan", "auto plans with --tensor-parallel are not supported yet: give --stages, --schedule "
                            "and --microbatches");
  }
  if (!spec->resume_from().empty()) {
    return Bad("auto_plan", "a resumed job keeps its source job's plan: give the source's --stages, --schedule "
                            "and --microbatches");
  }
  if (a.stages() && spec->split().split_at_size() > 0) {
    return Bad("split.stages", "auto chooses the cuts too: give --stages auto or --split-at, not both");
  }
  if (a.schedule() && spec->mode() == MODE_INFERENCE) {
    return Bad("schedule.kind", "an inference job has one schedule (inference): give --schedule inference");
  }
  const bool pick_kind = a.schedule() && sc.kind() == SCHEDULE_KIND_UNSPECIFIED;
  const bool pick_m = a.microbatches() && sc.microbatches() == 0;
  const bool pick_stages = a.stages() && spec->split().stages() == 0;
  JobSpec probe = *spec;
  probe.clear_auto_plan();
  if (pick_kind) {
    probe.mutable_schedule()->set_kind(SCHEDULE_GPIPE);
    probe.mutable_schedule()->set_stages_per_worker(0);
    if (probe.mode() == MODE_UNSPECIFIED) probe.set_mode(MODE_TRAIN);
  }
  if (pick_m) probe.mutable_schedule()->set_microbatches(1);
  if (pick_stages) probe.mutable_split()->set_stages(1);
  absl::Status checked = CheckSpec(&probe);
  if (!checked.ok()) return checked;
  *probe.mutable_auto_plan() = a;
  if (pick_kind) {
    probe.mutable_schedule()->set_kind(SCHEDULE_KIND_UNSPECIFIED);
    probe.mutable_schedule()->set_stages_per_worker(0);
  }
  if (pick_m) probe.mutable_schedule()->set_microbatches(0);
  if (pick_stages) probe.mutable_split()->set_stages(0);
  *spec = std::move(probe);
  return absl::OkStatus();
}

}  // namespace

bool AutoPlanned(const AutoPlanSpec& a) { return a.microbatches() || a.schedule() || a.stages(); }

bool PlanPending(const JobSpec& spec) {
  const AutoPlanSpec& a = spec.auto_plan();
  return (a.schedule() && spec.schedule().kind() == SCHEDULE_KIND_UNSPECIFIED) ||
         (a.microbatches() && spec.schedule().microbatches() == 0) || (a.stages() && spec.split().stages() == 0);
}

absl::Status CheckSpec(JobSpec* spec) {
  if (PlanPending(*spec)) return CheckAutoSpec(spec);
  ScheduleSpec* sched = spec->mutable_schedule();
  if (spec->has_serving()) {
    absl::Status serving = CheckServing(spec);
    if (!serving.ok()) return serving;
  }
  if (sched->kind() == SCHEDULE_KIND_UNSPECIFIED) return Bad("schedule.kind", "missing (e.g. 1f1b)");
  if (!ScheduleKind_IsValid(sched->kind())) return Bad("schedule.kind", absl::StrCat("unknown value ", sched->kind()));
  const bool forward_only = sched->kind() == SCHEDULE_INFERENCE;
  if (spec->mode() == MODE_UNSPECIFIED) spec->set_mode(forward_only ? MODE_INFERENCE : MODE_TRAIN);
  if (!Mode_IsValid(spec->mode())) return Bad("mode", "use train or inference");
  const bool train = spec->mode() == MODE_TRAIN;
  if (!train && !forward_only) return Bad("schedule.kind", "an inference job runs the inference schedule");
  if (train && forward_only) {
    return Bad("schedule.kind", "inference runs forward only; use mode inference or a training schedule");
  }
  if (sched->microbatches() < 1) return Bad("schedule.microbatches", "must be at least 1");
  if (sched->microbatches() > kMaxMicrobatches) {
    return Bad("schedule.microbatches", absl::StrCat("at most ", kMaxMicrobatches, " (a schedule holds an action per "
                                                     "micro-batch and stage; use larger micro-batches)"));
  }
  if (sched->stages_per_worker() < 0) return Bad("schedule.stages_per_worker", "must not be negative");
  if (sched->stages_per_worker() == 0) {
    sched->set_stages_per_worker(schedule::DefaultStagesPerRank(sched->kind()));
  }
  if (!Precision_IsValid(spec->precision())) return Bad("precision", "use fp32 or bf16");
  if (spec->precision() == PRECISION_UNSPECIFIED) spec->set_precision(PRECISION_FP32);
  absl::Status data = CheckData(spec);
  if (!data.ok()) return data;
  absl::Status eval = CheckEval(spec);
  if (!eval.ok()) return eval;
  const bool in_epochs = spec->epochs() > 0;  // the steps come when the dataset is indexed
  if (spec->steps() < 1 && !spec->has_serving() && !in_epochs) return Bad("steps", "must be at least 1");
  if (spec->batch_size() < 1) return Bad("batch_size", "must be at least 1");
  if (spec->replicas() < 0) return Bad("replicas", "must not be negative");
  if (spec->replicas() == 0) spec->set_replicas(1);
  if (spec->replicas() > 1 && !train) return Bad("replicas", "data parallelism is for training jobs");
  if (absl::Status tp = tp::CheckSpec(spec->tensor_parallel()); !tp.ok()) {
    return Bad("tensor_parallel", std::string(tp.message()));
  }
  if (spec->tensor_parallel().size() > 1) {
    if (!spec->resume_from().empty()) {
      return Bad("tensor_parallel", "--resume-from with tensor parallelism is not supported yet; submit without one of them");
    }
  }
  if (spec->batch_size() % (int64_t{spec->replicas()} * sched->microbatches()) != 0) {
    // The micro-batch counts that would fit (the divisors of the batch per replica).
    std::vector<int64_t> fit;
    const int64_t per_replica = spec->batch_size() % spec->replicas() == 0 ? spec->batch_size() / spec->replicas() : 0;
    for (int64_t m = 1; m <= per_replica && fit.size() < 12; ++m) {
      if (per_replica % m == 0) fit.push_back(m);
    }
    const std::string hint =
        fit.empty() ? absl::StrCat("; make batch_size a multiple of replicas (", spec->replicas(), ")")
                    : absl::StrCat("; use a schedule.microbatches that divides it: ", absl::StrJoin(fit, ", "),
                                   fit.size() == 12 ? ", ..." : "");
    return Bad("batch_size", spec->replicas() == 1
                                 ? absl::StrCat(spec->batch_size(), " does not split into ", sched->microbatches(),
                                                " equal micro-batches", hint)
                                 : absl::StrCat(spec->batch_size(), " does not split into ", spec->replicas(),
                                                " replicas x ", sched->microbatches(), " equal micro-batches", hint));
  }
  if (spec->split().stages() < 0) return Bad("split.stages", "must not be negative");
  if (spec->split().stages() == 0 && spec->split().split_at().empty()) {
    return Bad("split", "give split.stages or split.split_at");
  }
  if (!Balance_IsValid(spec->split().balance())) return Bad("split.balance", "use params, flops or time");
  if (spec->split().balance() == BALANCE_UNSPECIFIED) spec->mutable_split()->set_balance(BALANCE_PARAMS);
  if (!spec->resume_from().empty()) {
    if (!train || spec->has_serving()) return Bad("resume_from", "only a training job resumes from a checkpoint");
    if (spec->resume_from().size() > 128 ||
        spec->resume_from().find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") != std::string::npos) {
      return Bad("resume_from", "give a job id (pippyctl list shows them)");
    }
  }
  if (train) {
    if (spec->loss() == LOSS_UNSPECIFIED) return Bad("loss", "missing (mse, cross_entropy or model)");
    if (!LossKind_IsValid(spec->loss())) return Bad("loss", "use mse, cross_entropy or model");
    OptimizerSpec* o = spec->mutable_optimizer();
    if (o->kind() == OPTIMIZER_UNSPECIFIED) return Bad("optimizer.kind", "missing (sgd, adam or adamw)");
    if (!OptimizerKind_IsValid(o->kind())) return Bad("optimizer.kind", "use sgd, adam or adamw");
    for (const auto& [field, value] : {std::pair<const char*, double>{"optimizer.lr", o->lr()},
                                       {"optimizer.momentum", o->momentum()},
                                       {"optimizer.weight_decay", o->weight_decay()},
                                       {"optimizer.beta1", o->beta1()},
                                       {"optimizer.beta2", o->beta2()},
                                       {"optimizer.eps", o->eps()},
                                       {"optimizer.clip_grad_norm", o->clip_grad_norm()}}) {
      if (!std::isfinite(value)) return Bad(field, "must be a finite number");
    }
    if (!(o->lr() > 0)) return Bad("optimizer.lr", "must be > 0");
    if (o->momentum() < 0) return Bad("optimizer.momentum", "must not be negative");
    if (o->momentum() > 0 && o->kind() != OPTIMIZER_SGD) {
      return Bad("optimizer.momentum", "only sgd takes momentum (adam and adamw use beta1)");
    }
    if (!o->has_weight_decay()) o->set_weight_decay(DefaultWeightDecay(o->kind()));
    if (o->weight_decay() < 0) return Bad("optimizer.weight_decay", "must not be negative");
    if (!o->has_beta1()) o->set_beta1(0.9);
    if (!o->has_beta2()) o->set_beta2(0.999);
    if (!o->has_eps()) o->set_eps(1e-8);
    if (o->beta1() < 0 || o->beta1() >= 1) return Bad("optimizer.beta1", "must be in [0, 1)");
    if (o->beta2() < 0 || o->beta2() >= 1) return Bad("optimizer.beta2", "must be in [0, 1)");
    if (!(o->eps() > 0)) return Bad("optimizer.eps", "must be > 0");
    if (o->clip_grad_norm() < 0) return Bad("optimizer.clip_grad_norm", "must not be negative (0: no clipping)");
    if (!LrScheduleKind_IsValid(o->lr_schedule())) return Bad("optimizer.lr_schedule", "use constant, linear or cosine");
    if (o->lr_schedule() == LR_SCHEDULE_UNSPECIFIED) o->set_lr_schedule(LR_SCHEDULE_CONSTANT);
    const bool decays = o->lr_schedule() != LR_SCHEDULE_CONSTANT;
    if (o->warmup_steps() < 0) return Bad("optimizer.warmup_steps", "must not be negative (0: no warm-up)");
    if (decays && !in_epochs && o->warmup_steps() >= spec->steps()) {
      return Bad("optimizer.warmup_steps", absl::StrCat(o->warmup_steps(), " leaves none of the ", spec->steps(),
                                                        " steps to decay over; use fewer than steps"));
    }
    if (!std::isfinite(o->min_lr()) || o->min_lr() < 0) return Bad("optimizer.min_lr", "must be a finite number >= 0");
    if (o->min_lr() > o->lr()) {
      return Bad("optimizer.min_lr", absl::StrCat(o->min_lr(), " is above lr (", o->lr(), "); schedules decay to it"));
    }
    if (!decays && o->min_lr() > 0) {
      return Bad("optimizer.min_lr", "only the linear and cosine schedules decay to a min_lr (set lr_schedule)");
    }
  } else {
    const OptimizerSpec& o = spec->optimizer();
    if (o.lr_schedule() != LR_SCHEDULE_UNSPECIFIED || o.warmup_steps() != 0 || o.min_lr() != 0) {
      return Bad("optimizer.lr_schedule", "an inference job has no learning rate; leave out the schedule");
    }
  }
  FaultToleranceSpec* ft = spec->mutable_fault_tolerance();
  if (!ft->has_checkpoint_every()) ft->set_checkpoint_every(kDefaultCheckpointEvery);
  if (!ft->has_max_restarts()) ft->set_max_restarts(kDefaultMaxRestarts);
  if (!ft->has_recovery_timeout_s()) ft->set_recovery_timeout_s(kDefaultRecoveryTimeoutS);
  if (ft->checkpoint_every() < 0) return Bad("fault_tolerance.checkpoint_every", "must not be negative (0: none)");
  if (ft->max_restarts() < 0) return Bad("fault_tolerance.max_restarts", "must not be negative (0: no restart)");
  if (!(ft->recovery_timeout_s() > 0) || !std::isfinite(ft->recovery_timeout_s())) {
    return Bad("fault_tolerance.recovery_timeout_s", "must be a finite number > 0");
  }
  return absl::OkStatus();
}

}  // namespace pippy::job
