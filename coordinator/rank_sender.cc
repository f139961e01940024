#include "coordinator/rank_sender.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/chunker.h"
#include "common/log.h"
#include "coordinator/artifact_store.h"

namespace pippy::coordinator {
namespace {

using Sink = Chunker::Sink;

// Streams what `source` writes as chunk messages (the last, possibly short, says so)
// that `chunk_of` picks in a message. Returns the bytes sent; an error names `what`.
template <typename ChunkOf>
absl::StatusOr<int64_t> Stream(const RankSend& send, size_t chunk_bytes, const ChunkOf& chunk_of,
                               const std::function<absl::Status(const Sink&)>& source, const std::string& what) {
  const Assignment& a = send.assignment.assignment();
  absl::StatusOr<int64_t> sent = Chunker::Stream(
      chunk_bytes,
      [&](std::string chunk, bool last) -> absl::Status {
        if (send.stop->load()) return absl::CancelledError("the job ended");
        CoordinatorMessage m;
        auto* c = chunk_of(&m);
        c->set_job_id(a.job_id());
        c->set_attempt(a.attempt());
        c->set_chunk(std::move(chunk));
        c->set_last_chunk(last);
        return send.channel->Send(m) ? absl::OkStatus() : absl::UnavailableError("the worker's stream closed");
      },
      source);
  if (sent.ok() || absl::IsCancelled(sent.status()) || absl::IsUnavailable(sent.status())) return sent;
  return absl::Status(sent.status().code(), absl::StrCat("cannot send ", what, ": ", sent.status().message()));
}

}  // namespace

absl::Status SendRank(const RankSend& send, const StageWriter& writer, size_t chunk_bytes,
                      std::map<int, int64_t>* stage_bytes) {
  const Assignment& a = send.assignment.assignment();
  if (!send.channel->Send(send.assignment)) return absl::UnavailableError("the worker's stream closed");
  const auto start = absl::Now();
  int64_t sent = 0;
  for (size_t i = 0; i < send.stages.size(); ++i) {
    const int stage = send.stages[i];
    const int key = i < send.stage_files.size() ? send.stage_files[i] : stage;
    absl::StatusOr<int64_t> bytes = Stream(
        send, chunk_bytes,
        [stage](CoordinatorMessage* m) {
          m->mutable_stage()->set_stage(stage);
          return m->mutable_stage();
        },
        [&](const Sink& sink) { return writer(key, sink); }, absl::StrCat("stage ", stage, " to rank ", a.rank()));
    if (!bytes.ok()) return bytes.status();
    (*stage_bytes)[stage] = *bytes;
    sent += *bytes;
  }
  // The data share (a missing file: a rank that needs none, one empty last chunk).
  absl::StatusOr<int64_t> data = Stream(
      send, chunk_bytes, [](CoordinatorMessage* m) { return m->mutable_data(); },
      [&](const Sink& sink) {
        return ArtifactStore::FileSize(send.share_file) > 0 ? ArtifactStore::StreamFile(send.share_file, chunk_bytes, sink)
                                                            : absl::OkStatus();
      },
      absl::StrCat("rank ", a.rank(), " its data"));
  if (!data.ok()) return data.status();
  sent += *data;
  if (!send.state_file.empty()) {
    absl::StatusOr<int64_t> state = Stream(
        send, chunk_bytes, [](CoordinatorMessage* m) { return m->mutable_state(); },
        [&](const Sink& sink) { return ArtifactStore::StreamFile(send.state_file, chunk_bytes, sink); },
        absl::StrCat("rank ", a.rank(), " its training state"));
    if (!state.ok()) return state.status();
    sent += *state;
  }
  for (size_t i = 0; i < send.dataset_files.size(); ++i) {
    const std::string& file = send.dataset_files[i];
    absl::StatusOr<int64_t> shard = Stream(
        send, chunk_bytes,
        [i](CoordinatorMessage* m) {
          m->mutable_dataset()->set_shard(static_cast<int>(i));
          return m->mutable_dataset();
        },
        [&](const Sink& sink) { return ArtifactStore::StreamFile(file, chunk_bytes, sink); },
        absl::StrCat("rank ", a.rank(), " the dataset's shard ", file));
    if (!shard.ok()) return shard.status();
    sent += *shard;
  }
  log::Info("job={} rank={} sent {} bytes (stages and data share) in {}", a.job_id(), a.rank(), sent,
            absl::FormatDuration(absl::Now() - start));
  return absl::OkStatus();
}

}  // namespace pippy::coordinator
