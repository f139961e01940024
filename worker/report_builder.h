// What a rank tells the coordinator after each step: the StepReport built from the
// runtime's StepResult (loss, times, the breakdown, the timed actions with their kinds)
// and from what the process reads of itself right after the step (ProcessReadings).
// No stream: the worker sends what they build, and tests check it without a
// coordinator. A new per-step figure is read in ReadProcess and reported here.
#ifndef PIPPY_WORKER_REPORT_BUILDER_H_
#define PIPPY_WORKER_REPORT_BUILDER_H_

#include <cstdint>

#include "pipeline/stage/rank_runtime.h"
#include "proto/coordinator.pb.h"

namespace pippy::worker {

// The trace kind of a timed piece of a step: from its action's type, TRACE_OTHER for
// the rank's own work.
TraceKind TraceKindOf(const stage::TraceEvent& event);

// Tensor bytes a step moved to and from peer ranks (its SEND and RECV actions).
struct TransferBytes {
  int64_t sent = 0;
  int64_t received = 0;
};
TransferBytes TransferBytesOf(const stage::StepResult& result);

// What the process reads of itself after a step.
struct ProcessReadings {
  // One reading of the steady and the wall clock, taken together: the trace's steady
  // times become wall times with them.
  int64_t steady_now_us = 0;
  int64_t unix_now_us = 0;
  // The most resident memory of the process since the last reading (the step's peak).
  int64_t peak_memory_bytes = 0;
};
// Reads them now (the memory peak starts again from here: one reading per step).
ProcessReadings ReadProcess();

// The report of step `step` of the rank `assignment` runs.
StepReport BuildStepReport(const Assignment& assignment, int step, const stage::StepResult& result,
                           const ProcessReadings& readings);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_REPORT_BUILDER_H_
