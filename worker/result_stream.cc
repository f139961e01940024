#include "worker/result_stream.h"

#include "absl/strings/str_cat.h"
#include "common/chunker.h"
#include "common/log.h"
#include "common/status.h"
#include "common/test_hooks.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::worker {
namespace {

using Sink = Chunker::Sink;

// Streams what `source` writes in chunk messages that `chunk_of` picks in a message,
// for assignment `a`; `what` names them when the stream breaks. Returns the bytes sent.
template <typename ChunkOf>
absl::StatusOr<int64_t> Stream(const Writer& write, const Assignment& a, size_t chunk_bytes, const ChunkOf& chunk_of,
                               const std::function<absl::Status(const Sink&)>& source, const char* what) {
  return Chunker::Stream(
      chunk_bytes,
      [&](std::string chunk, bool last) -> absl::Status {
        WorkerMessage m;
        auto* c = chunk_of(&m);
        c->set_job_id(a.job_id());
        c->set_attempt(a.attempt());
        c->set_chunk(std::move(chunk));
        c->set_last_chunk(last);
        if (!write(m)) {
          return absl::UnavailableError(absl::StrCat("the stream to the coordinator broke while sending ", what));
        }
        return absl::OkStatus();
      },
      source);
}

}  // namespace

absl::Status SendStage(const Writer& write, const Assignment& a, int stage, const torch::jit::Module& module,
                       size_t chunk_bytes) {
  auto sent = Stream(
      write, a, chunk_bytes,
      [stage, &a](WorkerMessage* m) {
        m->mutable_stage_result()->set_stage(stage);
        m->mutable_stage_result()->set_tp_rank(a.tp_rank());
        return m->mutable_stage_result();
      },
      [&](const Sink& sink) { return torchio::WriteModule(module, sink); }, "results");
  return sent.status();
}

absl::Status SendOutputs(const Writer& write, const Assignment& a, const std::vector<c10::IValue>& outputs,
                         size_t chunk_bytes) {
  PIPPY_ASSIGN_OR_RETURN(c10::IValue merged, stage::MergeMicrobatches(outputs));
  std::vector<char> bytes = torch::jit::pickle_save(merged);
  auto sent = Stream(
      write, a, chunk_bytes, [](WorkerMessage* m) { return m->mutable_output(); },
      [&](const Sink& sink) { return sink(absl::string_view(bytes.data(), bytes.size())); }, "outputs");
  return sent.status();
}

absl::Status SendCheckpoint(const Writer& write, const Assignment& a, int step, job::RankJob& rank_job,
                            bool with_stages, size_t chunk_bytes) {
  const auto start = absl::Now();
  int64_t bytes = 0;
  int chunks = 0;
  auto piece = [&](int stage) {
    return [&, stage](WorkerMessage* m) {
      // Called once per chunk, before it is written: the test's fault strikes once the
      // first chunk went (a checkpoint is at least a stage and a state: 2 chunks).
      if (chunks++ == 1) test_hooks::MaybeDieInCheckpoint(step);
      CheckpointChunk* c = m->mutable_checkpoint();
      c->set_step(step);
      c->set_rank(a.rank());
      c->set_replica(a.replica());
      c->set_tp_rank(a.tp_rank());
      c->set_stage(stage);
      return c;
    };
  };
  // The replicas hold the same parameters: replica 0 sends the stages, every replica
  // its training state (its own random generator).
  for (const auto& stage : rank_job.stages()) {  // not a structured binding: the lambda captures it
    if (a.replica() != 0 || !with_stages) break;
    const torch::jit::Module& module = stage.second;
    auto source = [&](const Sink& sink) { return torchio::WriteModule(module, sink); };
    PIPPY_ASSIGN_OR_RETURN(int64_t n, Stream(write, a, chunk_bytes, piece(stage.first), source, "a checkpoint"));
    bytes += n;
  }
  PIPPY_ASSIGN_OR_RETURN(std::string state, rank_job.SaveState());
  PIPPY_ASSIGN_OR_RETURN(int64_t n, Stream(write, a, chunk_bytes, piece(-1),
                                           [&](const Sink& sink) { return sink(state); }, "a checkpoint"));
  bytes += n;
  log::Info("job={} rank={} checkpoint after step {}: {} bytes in {}", a.job_id(), a.rank(), step, bytes,
            absl::FormatDuration(absl::Now() - start));
  return absl::OkStatus();
}

}  // namespace pippy::worker
