// A serving job's rank once it is up: it runs each micro-batch the coordinator sends
// (ServeBatch, in step order) as soon as it comes, without waiting for later ranks to
// finish earlier ones; the last stage's rank returns each output (ServeResult). A
// micro-batch whose inputs do not fit the model is abandoned on every rank (ABORTED)
// and serving goes on; any other error, or a cancel, ends the rank.
//
// Thread safety: runs on the rank's thread; `control` delivers the micro-batches.
#ifndef PIPPY_WORKER_SERVING_LOOP_H_
#define PIPPY_WORKER_SERVING_LOOP_H_

#include "absl/status/status.h"
#include "pipeline/job/rank_job.h"
#include "proto/coordinator.pb.h"
#include "worker/rank_control.h"
#include "worker/result_stream.h"
#include "worker/worker_metrics.h"

namespace pippy::worker {

// Returns when serving ends. Errors: CANCELLED (the job was cancelled or the
// coordinator lost); UNAVAILABLE when the stream broke; a step's other errors.
absl::Status RunServing(const Assignment& a, job::RankJob& rank_job, RankControl& control, const Writer& write,
                        WorkerMetrics& metrics);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_SERVING_LOOP_H_
