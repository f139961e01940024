#include "worker/report_builder.h"

#include <chrono>

#include "absl/time/clock.h"
#include "common/memory.h"

namespace pippy::worker {

TraceKind TraceKindOf(const stage::TraceEvent& event) {
  if (!event.action.has_value()) return TRACE_OTHER;
  if (schedule::Action::IsSend(*event.action)) return TRACE_SEND;
  if (schedule::Action::IsRecv(*event.action)) return TRACE_RECV;
  return TRACE_COMPUTE;
}

TransferBytes TransferBytesOf(const stage::StepResult& result) {
  TransferBytes out;
  for (const stage::TraceEvent& t : result.trace) {
    const TraceKind kind = TraceKindOf(t);
    if (kind == TRACE_SEND) out.sent += t.bytes;
    if (kind == TRACE_RECV) out.received += t.bytes;
  }
  return out;
}

ProcessReadings ReadProcess() {
  ProcessReadings r;
  r.steady_now_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  r.unix_now_us = absl::ToUnixMicros(absl::Now());
  r.peak_memory_bytes = TakePeakResidentBytes();
  return r;
}

StepReport BuildStepReport(const Assignment& a, int step, const stage::StepResult& res,
                           const ProcessReadings& readings) {
  StepReport r;
  r.set_job_id(a.job_id());
  r.set_rank(a.rank());
  r.set_step(step);
  r.set_attempt(a.attempt());
  r.set_replica(a.replica());
  r.set_tp_rank(a.tp_rank());
  r.set_has_loss(res.has_loss);
  r.set_loss(res.loss);
  r.set_lr(res.lr);
  r.set_busy_seconds(res.busy_seconds);
  r.set_step_seconds(res.step_seconds);
  StepBreakdown* bd = r.mutable_breakdown();
  bd->set_rank(a.rank());
  bd->set_replica(a.replica());
  bd->set_tp_rank(a.tp_rank());
  bd->set_step_seconds(res.step_seconds);
  bd->set_compute_seconds(res.breakdown.compute_seconds);
  bd->set_wait_seconds(res.breakdown.wait_seconds);
  bd->set_transport_seconds(res.breakdown.transport_seconds);
  bd->set_optimizer_seconds(res.breakdown.optimizer_seconds);
  bd->set_other_seconds(res.breakdown.other_seconds);
  bd->set_allreduce_seconds(res.breakdown.allreduce_seconds);
  bd->set_allreduce_wait_seconds(res.breakdown.allreduce_wait_seconds);
  bd->set_tp_allreduce_seconds(res.breakdown.tp_allreduce_seconds);
  bd->set_tp_allreduces(res.breakdown.tp_allreduces);
  bd->set_peak_memory_bytes(readings.peak_memory_bytes);
  for (const stage::TraceEvent& t : res.trace) {
    TraceEvent* e = r.add_events();
    e->set_name(t.name);
    e->set_stage(t.stage);
    e->set_begin_us(t.begin_us);
    e->set_duration_us(t.duration_us);
    e->set_bytes(t.bytes);
    e->set_wait_us(t.wait_us);
    e->set_kind(TraceKindOf(t));
  }
  r.set_steady_anchor_us(readings.steady_now_us);
  r.set_unix_anchor_us(readings.unix_now_us);
  return r;
}

}  // namespace pippy::worker
