// What a serving job's pipeline is fed by: the requests of a serving job (ServingQueue:
// one forward per request) or of a generation job (GenerationQueue: tokens decoded
// through the pipeline). JobRun holds one for the job's whole life and drives it as the
// job's pipeline comes and goes; the ranks' answers (ServeResult) come back through it.
//
// Thread safety: every method may be called from any thread.
#ifndef PIPPY_COORDINATOR_REQUEST_QUEUE_H_
#define PIPPY_COORDINATOR_REQUEST_QUEUE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

class RequestQueue {
 public:
  // Sends micro-batch `batch` (its step, rows and, for generation, its rows' sampling
  // set; JobRun adds the job, the attempt and the bounds) to every rank: inputs[r] is
  // rank r's pickled tuple of model inputs ("" for a rank that reads none). Returns
  // false if a rank's stream is gone.
  using Dispatch = std::function<bool(const ServeBatch& batch, const std::vector<std::string>& inputs)>;

  virtual ~RequestQueue() = default;
  // The pipeline of `attempt` is ready: `rank_inputs[r]` lists the model inputs rank
  // r's stages read. Queued requests start to flow.
  virtual void Start(int attempt, std::vector<std::vector<int>> rank_inputs, Dispatch dispatch) = 0;
  // The pipeline is gone (a worker lost; the job may be placed again): requests in it
  // fail with `why`; queued ones wait for the next Start.
  virtual void Pause(const absl::Status& why) = 0;
  // The job ended: every request fails with `why`; later ones are refused.
  virtual void Stop(const absl::Status& why) = 0;
  // The last rank's answer for a micro-batch (other attempts' are ignored).
  virtual void OnResult(const ServeResult& result) = 0;
  // The message bound of the coordinator it runs in.
  virtual void SetMaxMessageBytes(int64_t bytes) = 0;
  // What a micro-batch's output may take in one message to the coordinator.
  virtual int64_t MessageBudget() const = 0;
  virtual ServingStats Stats() const = 0;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_REQUEST_QUEUE_H_
