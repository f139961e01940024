// What a rank sends back to the coordinator besides its step reports, each as chunk
// messages of at most kResultChunk bytes (the last says so), written as they are made:
// its trained stages at the end of a training job (StageResult), an inference job's
// merged outputs (InferenceOutput), and checkpoints (CheckpointChunk: each stage's
// TorchScript, from replica 0 only, then the rank's training state).
//
// Thread safety: as the Writer given (the rank's thread calls these).
#ifndef PIPPY_WORKER_RESULT_STREAM_H_
#define PIPPY_WORKER_RESULT_STREAM_H_

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "pipeline/job/rank_job.h"
#include "proto/coordinator.pb.h"
#include "torch/script.h"

namespace pippy::worker {

constexpr size_t kResultChunk = 1 << 20;

// Writes one message to the coordinator; false when the stream is gone.
using Writer = std::function<bool(const WorkerMessage&)>;

// Errors (all three): UNAVAILABLE when the stream broke (naming what was being sent);
// INTERNAL from LibTorch's writer.
absl::Status SendStage(const Writer& write, const Assignment& a, int stage, const torch::jit::Module& module,
                       size_t chunk_bytes = kResultChunk);
absl::Status SendOutputs(const Writer& write, const Assignment& a, const std::vector<c10::IValue>& outputs,
                         size_t chunk_bytes = kResultChunk);
// A checkpoint after `step` steps. The coordinator commits it once every rank's pieces
// arrived whole. `with_stages` false: the rank's training state only (after the last
// step, whose stages go as results).
absl::Status SendCheckpoint(const Writer& write, const Assignment& a, int step, job::RankJob& rank_job,
                            bool with_stages = true, size_t chunk_bytes = kResultChunk);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_RESULT_STREAM_H_
