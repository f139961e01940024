// A generation job's sequences on the coordinator (pippyctl serve --generate): prompts
// admitted into the KV caches' slots as slots free up, decoded through the pipeline by
// continuous batching, and their tokens streamed back as they are sampled.
//
// The model follows the generation contract (docs/api.md#generation): forward(idx,
// input_pos, slots) writes each row's keys and values at (slot, position) of the caches
// its stages hold and attends to that slot's positions up to the row's. The caches stay
// on the workers; every micro-batch carries only token ids, positions and slots (to the
// ranks that read them), and the last stage's rank returns one sampled token per row.
//
// Scheduling, per pipeline iteration:
// - A waiting request takes a free slot (oldest first); without one it waits.
// - A sequence is in at most one micro-batch at a time (its next row needs its last
//   token). The active sequences are split into max_inflight groups (default: one per
//   stage; a new sequence joins the smallest); each group is one micro-batch in the
//   pipeline, so the groups follow each other through the stages and no stage waits
//   for the last stage's sampling (vLLM's pipeline-parallel design). A group larger
//   than its share (ceil(active / groups)) hands sequences to the smallest group when
//   it is next formed, so the groups stay even as sequences end.
// - A micro-batch is either decodes (one token per row) or prompt chunks of one length
//   (at most prefill_chunk tokens in all): rows never share a padded tensor. When both
//   wait, they alternate, so a long prompt's prefill does not stall the decodes.
// - A sequence ends at max_new_tokens ("length"), after a stop token ("stop"), or when
//   its next position would pass max_seq ("max_seq"); its slot is free for the next.
//   A cancelled request (the client went away, its deadline passed) ends at the next
//   iteration and frees its slot.
//
// Failures: a micro-batch the model fails fails its sequences (INTERNAL, the model's
// message) and the others go on; a lost pipeline (Pause) fails every sequence holding a
// slot with UNAVAILABLE (their caches are gone), and the waiting ones go on on the next
// attempt's pipeline.
//
// Threads: every method may be called from any thread; one scheduler thread forms the
// micro-batches and calls `dispatch`. `on_event` callbacks of one sequence are called
// one at a time, in order, on the thread that completes its micro-batch (OnResult's,
// Pause's, Stop's or the scheduler's), and must not block or call back into the queue.
//
// The header is free of LibTorch; generation.cc uses it.
#ifndef PIPPY_COORDINATOR_GENERATION_H_
#define PIPPY_COORDINATOR_GENERATION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "coordinator/request_queue.h"

namespace pippy::coordinator {

class GenerationQueue : public RequestQueue {
 public:
  struct Options {
    std::string job_id;        // for logs
    int max_inflight = 1;      // groups, each one micro-batch in the pipeline at once (>= 1; the job's stages)
    int max_batch = 32;        // sequences per micro-batch
    int max_slots = 1;         // of the caches
    int max_seq = 1;           // positions per slot
    int prefill_chunk = 64;    // prompt tokens per prefill micro-batch
    int64_t vocab = 0;         // token ids must be < vocab (0: unchecked)
    int max_queued = 4096;     // waiting requests; more: RESOURCE_EXHAUSTED
  };

  struct Request {
    std::vector<int64_t> prompt;
    int max_new_tokens = 16;
    float temperature = 0;     // 0: greedy
    int top_k = 0;
    float top_p = 0;
    uint64_t seed = 0;
    std::vector<int64_t> stop_tokens;
  };

  // What a sequence's client is told: new tokens, and at the end (done, or an error).
  struct Event {
    absl::Status status;       // not OK: the sequence failed (the last event)
    std::vector<int64_t> tokens;
    bool done = false;
    std::string finish_reason; // with done: "length", "stop", "max_seq"
    int generated = 0;         // tokens so far
    double ttft_ms = -1;       // arrival to the first token, once there is one
  };
  using OnEvent = std::function<void(Event)>;

  explicit GenerationQueue(const Options& options);
  ~GenerationQueue() override;  // fails what is left (UNAVAILABLE) and joins the scheduler

  // Checks the request and queues it; once OK is returned, `on_event` is called until
  // an event that is done or not OK. Errors: INVALID_ARGUMENT (an empty prompt, a token
  // outside [0, vocab), a prompt longer than max_seq, a bad sampling parameter);
  // RESOURCE_EXHAUSTED when max_queued requests wait already; the stop reason once stopped.
  absl::Status Submit(Request request, OnEvent on_event,
                      std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // A prompt sent as bytes: torch.save of a 1-D (or [1, L]) integer tensor, or of a
  // list of ints. Errors: INVALID_ARGUMENT naming what it is instead.
  static absl::StatusOr<std::vector<int64_t>> ParsePrompt(const std::string& bytes);

  void Start(int attempt, std::vector<std::vector<int>> rank_inputs, Dispatch dispatch) override;
  void Pause(const absl::Status& why) override;
  void Stop(const absl::Status& why) override;
  void OnResult(const ServeResult& result) override;
  void SetMaxMessageBytes(int64_t bytes) override;
  int64_t MessageBudget() const override;
  ServingStats Stats() const override;  // with its GenerationStats

  // The last micro-batches (at most 256) as the coordinator saw them, from dispatch to
  // the sampled tokens' return, one event each ("prefill 2x16", "decode 8"), on one
  // lane per micro-batch in flight: GetTrace's answer for a generation job (rank -1,
  // times in unix µs). Errors: NOT_FOUND before the first micro-batch came back.
  absl::StatusOr<StepTrace> Trace(const std::string& job_id) const;
  // Time to first token and inter-token latency (seconds), for /metrics.
  metrics::Histogram TtftSeconds() const;
  metrics::Histogram ItlSeconds() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_GENERATION_H_
