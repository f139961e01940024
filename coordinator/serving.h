// A serving job's requests on the coordinator: checked as they arrive, grouped into
// micro-batches, sent through the pipeline one after the other, and answered with
// their own rows of the output.
//
// Batching: requests are bucketed by the dtype and every dimension but the first of
// each input (so requests of different sequence lengths never share a micro-batch:
// no padding, which would change the outputs of a model that does not mask it). A
// bucket leaves as a micro-batch once it holds max_batch rows, or once its oldest
// request has waited max_delay; a request of more rows than max_batch is cut into
// several micro-batches and its parts put back together. In the pipeline at once: up
// to `stages` micro-batches (one per stage), and while that many are in it a further
// one leaves only full (max_batch rows), up to max_inflight: so stage 0 gets its next
// micro-batch as soon as it is free when requests are plenty, and when they are few
// they wait for room and make larger micro-batches instead of many small ones.
//
// Isolation: a micro-batch that a stage's forward refuses (ServeResult.aborted) is
// answered as follows: a micro-batch of one request fails it with INVALID_ARGUMENT
// and the model's message; one of several requests sends each of them again alone,
// so that only the request that does not fit the model fails.
//
// Threads: Submit, Start, Pause, Stop, OnResult and Stats may be called from any
// thread; one batcher thread per queue forms micro-batches and calls `dispatch` (so
// the ranks receive them in step order). `done` callbacks run on the thread that
// completes the request (OnResult's, Pause's or Stop's, or the batcher's) and must
// not block or call back into the queue.
//
// The header is free of LibTorch; serving.cc uses it.
#ifndef PIPPY_COORDINATOR_SERVING_H_
#define PIPPY_COORDINATOR_SERVING_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "coordinator/request_queue.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

class ServingQueue : public RequestQueue {
 public:
  struct Options {
    std::string job_id;                   // for logs
    int max_batch = 32;
    absl::Duration max_delay = absl::Milliseconds(5);
    int stages = 1;                        // of the pipeline
    int max_inflight = 2;                  // micro-batches in it at most (>= 1)
    std::vector<std::string> input_names;  // forward()'s arguments
    std::vector<std::string> input_dtypes; // per argument, as the plan saw them ("float32"; "" unknown)
    std::vector<int> input_dims;           // per argument, number of dimensions (-1 unknown)
    int max_queued = 4096;                 // requests waiting at once; more: RESOURCE_EXHAUSTED
    // The most bytes of tensors a micro-batch's inputs, and its output, may hold: they
    // travel in one gRPC message each (to the workers, back to the coordinator, whose
    // --max-message-mib bounds it). Micro-batches take fewer rows to stay within it; a
    // request one row of which is larger, or whose output alone is, fails alone with
    // RESOURCE_EXHAUSTED (the connection and the job go on).
    int64_t max_message_bytes = int64_t{16} << 20;
  };

  struct Answer {
    absl::Status status;
    std::string output;                   // torch.save bytes of the request's rows of the output
    int64_t rows = 0;
    double queue_ms = 0;
    double pipeline_ms = 0;
    int microbatch_rows = 0;
  };
  using Done = std::function<void(Answer)>;

  explicit ServingQueue(const Options& options);
  ~ServingQueue() override;  // fails what is left (UNAVAILABLE) and joins the batcher

  // Checks the request (a torch.save'd tensor, tuple, list or dict of forward()'s
  // arguments, or a data file's "inputs") and queues it; `done` is called exactly once
  // when OK is returned. Once `*cancelled` is set (the client went away or its deadline
  // passed), a request still waiting is dropped (CANCELLED) instead of computed.
  // Errors: INVALID_ARGUMENT naming the input and what is wrong; RESOURCE_EXHAUSTED
  // when options.max_queued requests wait already; UNAVAILABLE once stopped.
  absl::Status Submit(std::string input, Done done,
                      std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);
  void Start(int attempt, std::vector<std::vector<int>> rank_inputs, Dispatch dispatch) override;
  void Pause(const absl::Status& why) override;
  void Stop(const absl::Status& why) override;
  void OnResult(const ServeResult& result) override;
  // Options::max_message_bytes of the coordinator it runs in.
  void SetMaxMessageBytes(int64_t bytes) override;
  // What a micro-batch's tensors, and its pickled output, may take: the message bound
  // less room for the rest of the message (pickle framing, ids).
  int64_t MessageBudget() const override;
  ServingStats Stats() const override;
  // Request latency (arrival to answer, seconds) of every answered request, for /metrics.
  metrics::Histogram LatencySeconds() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_SERVING_H_
