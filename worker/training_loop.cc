#include "worker/training_loop.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "pipeline/job/job_spec.h"
#include "worker/report_builder.h"

namespace pippy::worker {

absl::Status RunTrainingSteps(const Assignment& a, job::RankJob& rank_job, stage::BatchSource& data,
                              stage::BatchSource* eval_data, const Writer& write, WorkerMetrics& metrics) {
  const JobSpec& spec = a.spec();
  const bool inference = rank_job.schedule().forward_only;
  std::vector<c10::IValue> outputs;  // inference: the last stage's merged outputs per step
  int eval_steps = 0;                // evaluation batches run (they number their messages)
  for (int step = a.start_step(); step < spec.steps(); ++step) {
    PIPPY_ASSIGN_OR_RETURN(stage::StepResult res, rank_job.RunStep(step, data));
    if (inference && !res.output.isNone()) outputs.push_back(res.output);
    WorkerMessage report;
    *report.mutable_step() = BuildStepReport(a, step, res, ReadProcess());
    if (!inference && job::EvalAfter(spec, step + 1)) {
      const auto start = absl::Now();
      double sum = 0;
      bool has_loss = false;
      for (int b = 0; b < spec.eval().batches(); ++b) {
        absl::StatusOr<stage::StepResult> e = rank_job.EvalStep(eval_steps++, b, eval_data);
        if (!e.ok()) {
          return absl::Status(e.status().code(),
                              absl::StrCat("evaluating after step ", step, " (batch ", b, "): ", e.status().message()));
        }
        sum += e->loss;
        has_loss |= e->has_loss;
      }
      if (has_loss) {
        const double loss = sum / spec.eval().batches();
        report.mutable_step()->set_has_eval_loss(true);
        report.mutable_step()->set_eval_loss(loss);
        log::Info("job={} rank={} evaluated after step {}: loss={} over {} batches in {}", a.job_id(), a.rank(), step,
                  loss, spec.eval().batches(), absl::FormatDuration(absl::Now() - start));
      }
    }
    write(report);
    log::Info("job={} rank={} step={}{}", a.job_id(), a.rank(), step,
              res.has_loss ? absl::StrCat(" loss=", res.loss) : "");
    metrics.OnStep(res, /*serving=*/false);
    if (job::CheckpointAfter(spec, step + 1)) {
      PIPPY_RETURN_IF_ERROR(SendCheckpoint(write, a, step + 1, rank_job));
      metrics.OnCheckpoint();
    }
  }
  if (inference) return outputs.empty() ? absl::OkStatus() : SendOutputs(write, a, outputs);
  // The state after the last step first: the coordinator keeps it with the results as
  // the job's last checkpoint (a later job resumes from it).
  if (job::KeepsFinalState(spec) && a.start_step() < spec.steps()) {
    PIPPY_RETURN_IF_ERROR(SendCheckpoint(write, a, spec.steps(), rank_job, /*with_stages=*/false));
  }
  if (a.replica() != 0) return absl::OkStatus();  // the replicas hold the same parameters
  for (const auto& [s, module] : rank_job.stages()) PIPPY_RETURN_IF_ERROR(SendStage(write, a, s, module));
  return absl::OkStatus();
}

}  // namespace pippy::worker
