// The worker daemon's agent: the rooms of a worker wired together. Its Session
// (session.h) dials the coordinator, registers and reads the stream; an assignment's
// files are collected by an AssignmentReceiver; once they are all in, a rank thread
// brings the rank up (rank_bringup.h: stages loaded from the received bytes, the UCX
// and staging transports, the peers' addresses from the coordinator), sets it up with
// job::RankJob on its piece of the job's layout, and runs it: the training loop
// (training_loop.h) or the serving loop (serving_loop.h), then reports the rank
// finished. A cancel, or the coordinator lost, reaches the rank through RankControl.
//
// A worker receives only its own stages' TorchScript files and its share of the data
// (never the whole model), loads the stages straight from the received bytes and frees
// the bytes.
//
// Threads: the session's reader thread handles messages and collects files; the
// session's heartbeat thread; one rank thread at a time runs the assigned rank and
// writes its reports, checkpoints and results.
#ifndef PIPPY_WORKER_WORKER_AGENT_H_
#define PIPPY_WORKER_WORKER_AGENT_H_

#include <memory>
#include <string>
#include <vector>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "c10/core/Device.h"
#include "common/device.h"
#include "pipeline/stage/batch_source.h"
#include "worker/assignment_receiver.h"
#include "worker/rank_control.h"
#include "worker/session.h"
#include "worker/worker_metrics.h"

namespace pippy::worker {

struct AgentOptions {
  std::string coordinator = "localhost:7070";
  std::string name;
  std::string device = "cpu";  // --device: cpu | cuda[:N] | auto
  int threads = 1;
  std::string ucx_tls;  // empty: UCX chooses
  // Data parallelism: the address other replicas reach this worker's gloo endpoints at
  // (empty: the host's name).
  std::string replica_host;
  absl::Duration heartbeat = absl::Seconds(1);
  absl::Duration wait_timeout = absl::Seconds(60);  // each wait inside a step
  absl::Duration connect_timeout = absl::Seconds(10);
  // After losing the coordinator: how long to keep dialling (with backoff) before
  // giving up; 0: give up at once.
  absl::Duration reconnect_timeout = absl::Seconds(300);
  // grpc.health.v1.Health on this port (all interfaces): SERVING while registered with
  // the coordinator, NOT_SERVING while (re)connecting. -1: none.
  int health_port = -1;
  // Prometheus metrics at http://0.0.0.0:PORT/metrics. -1: none.
  int metrics_port = -1;
  // TLS to the coordinator: the CA that signed its certificate; this worker's
  // certificate and key for mTLS (--tls-client-ca on the coordinator). Empty: plain.
  std::string tls_ca, tls_cert, tls_key;
  // Folders a job's dataset may be read from (--dataset-root; stage/dataset.h). None:
  // jobs with a dataset fail on this worker, naming the flag.
  std::vector<std::string> dataset_roots;
  // Where the shards of datasets uploaded with a submission (--dataset-upload) are
  // written for the ranks that read them, a folder per rank, removed when it ends.
  // Empty: the system's temporary folder ($TMPDIR).
  std::string scratch_dir;
};

// Connects and serves. When the coordinator goes away (it stopped, restarted, or the
// network broke) the worker stops its rank and reconnects, registering under the id
// it had, for up to reconnect_timeout.
// Errors: UNAVAILABLE when the coordinator cannot be reached at first (within
// connect_timeout) or again (within reconnect_timeout);
// INVALID_ARGUMENT for options this build cannot serve (a device it lacks).
absl::Status RunAgent(const AgentOptions& options);

class Agent : public Session::Handler {
 public:
  // `device`: resolved and checked (ProcessDevice).
  Agent(const AgentOptions& options, Device device);
  ~Agent() override;

  // Serves the coordinator until it is lost for good (Session::Run).
  absl::Status Run();

  // Session::Handler, on the reader thread.
  void OnMessage(const CoordinatorMessage& message) override;
  void OnDisconnected() override;

 private:
  RegisterWorker Registration() const;
  void OnAssignment(const Assignment& assignment);
  template <typename Chunk>
  void OnChunk(const Chunk& chunk);
  void OnCancel(const CancelAssignment& cancel);
  // Reports the rank finished, with `status`.
  void Finished(const Assignment& a, const absl::Status& status);
  // The rank thread: runs the received assignment, then reports it finished.
  void RunAssignment(ReceivedAssignment in);
  absl::Status RunRank(ReceivedAssignment in);
  std::string ReplicaHost() const;
  // The rank's batches: its share of the job's data file (`share`), or, for a dataset
  // job, the dataset read here (stage/dataset.h) under `roots` (--dataset-root, or an
  // uploaded dataset's folder on this worker).
  absl::StatusOr<std::unique_ptr<stage::BatchSource>> OpenData(const Assignment& a,
                                                               const std::vector<std::string>& input_names,
                                                               const std::string& share,
                                                               const std::vector<std::string>& roots) const;

  const AgentOptions options_;
  const Device device_;             // resolved and checked (ProcessDevice)
  const c10::Device torch_device_;  // the same, as LibTorch names it
  WorkerMetrics metrics_;
  RankControl control_;
  std::unique_ptr<Session> session_;
  // Reader thread only.
  AssignmentReceiver receiver_;
  std::thread rank_thread_;
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_WORKER_AGENT_H_
