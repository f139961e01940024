#include "worker/serving_loop.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "worker/token_sampler.h"

namespace pippy::worker {
namespace {

// The micro-batch's forward() arguments: None where this rank reads none.
absl::StatusOr<std::vector<c10::IValue>> ArgumentsOf(const ServeBatch& batch, int inputs) {
  std::vector<c10::IValue> args(static_cast<size_t>(inputs));
  if (batch.inputs().empty()) return args;
  absl::StatusOr<c10::IValue> v = torchio::PickleLoad(batch.inputs(), "a serving micro-batch");
  if (!v.ok()) return v.status();
  if (!v->isTuple() || v->toTupleRef().elements().size() != args.size()) {
    return absl::InternalError(absl::StrCat("step ", batch.step(), ": the coordinator sent ", v->tagKind(),
                                            " instead of a tuple of ", args.size(), " input(s)"));
  }
  return v->toTupleRef().elements().vec();
}

WorkerMessage ResultOf(const Assignment& a, const ServeBatch& batch, const absl::StatusOr<stage::StepResult>& res) {
  const int64_t step = batch.step();
  WorkerMessage m;
  ServeResult* r = m.mutable_serve_result();
  r->set_job_id(a.job_id());
  r->set_attempt(a.attempt());
  r->set_step(step);
  r->set_ok(res.ok());
  if (!res.ok()) {
    r->set_aborted(absl::IsAborted(res.status()));
    r->set_error(std::string(res.status().message()));
  } else if (batch.sample_size() > 0) {
    // A generation micro-batch: only the sampled token ids go back.
    r->set_seconds(res->step_seconds);
    absl::StatusOr<std::vector<int64_t>> tokens =
        res->output.isTensor() ? SampleTokens(res->output.toTensor(), batch.sample())
                               : absl::InvalidArgumentError(absl::StrCat("a generation model returns a tensor of "
                                                                         "logits; this one returned a ",
                                                                         res->output.tagKind()));
    if (!tokens.ok()) {
      r->set_ok(false);
      r->set_aborted(true);
      r->set_error(std::string(tokens.status().message()));
      return m;
    }
    for (int64_t t : *tokens) r->add_tokens(t);
  } else {
    r->set_seconds(res->step_seconds);
    std::vector<char> bytes = torch::jit::pickle_save(res->output);
    if (batch.max_output_bytes() > 0 && static_cast<int64_t>(bytes.size()) > batch.max_output_bytes()) {
      // Sent as it is, it would end this worker's stream to the coordinator.
      r->set_ok(false);
      r->set_too_large(true);
      r->set_error(absl::StrCat("the output of ", batch.rows(), " rows is ", bytes.size(),
                                " bytes, more than one message to the coordinator may carry (",
                                batch.max_output_bytes(), " bytes: its --max-message-mib)"));
      return m;
    }
    r->set_output(bytes.data(), bytes.size());
  }
  return m;
}

}  // namespace

absl::Status RunServing(const Assignment& a, job::RankJob& rank_job, RankControl& control, const Writer& write,
                        WorkerMetrics& metrics) {
  // The last stage's rank answers; with tensor parallelism, shard 0's (the shards' outputs are alike).
  const bool last = rank_job.schedule().stage_to_rank.back() == a.rank() && a.tp_rank() == 0;
  log::Info("job={} rank={}: serving", a.job_id(), a.rank());
  while (true) {
    absl::StatusOr<ServeBatch> batch = control.NextServe();
    if (!batch.ok()) return batch.status();
    absl::StatusOr<std::vector<c10::IValue>> args = ArgumentsOf(*batch, a.plan().inputs_size());
    if (!args.ok()) return args.status();
    // Steps number the messages between ranks (the tag keeps their low 16 bits).
    absl::StatusOr<stage::StepResult> res = rank_job.ServeStep(static_cast<int>(batch->step() & 0x7fffffff), *args);
    if (!res.ok() && !absl::IsAborted(res.status())) {
      if (last && !absl::IsCancelled(res.status())) write(ResultOf(a, *batch, res));
      return res.status();
    }
    if (res.ok()) {
      metrics.OnStep(*res, /*serving=*/true);
    } else {
      metrics.OnAbortedStep();
    }
    if (last && !write(ResultOf(a, *batch, res))) {
      return absl::UnavailableError("the stream to the coordinator broke while sending a serving output");
    }
  }
}

}  // namespace pippy::worker
