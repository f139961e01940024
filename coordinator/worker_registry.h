// The workers registered with the coordinator: the id each was given (kept when it
// reconnects), what it registered (host, device, memory, threads), its stream, when it
// was last heard from, and the rank of a job it holds. Placement asks it for workers
// that fit a job's ranks (Fit).
//
// Thread safety: none of its own: the Coordinator owns it and calls it with its mutex
// held.
#ifndef PIPPY_COORDINATOR_WORKER_REGISTRY_H_
#define PIPPY_COORDINATOR_WORKER_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/device.h"
#include "coordinator/worker_channel.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// Tensor parallelism: `chosen` (workers by global rank, (replica * tp + shard) * ranks +
// rank) reordered so that each tensor-parallel group (the tp workers of one replica and
// rank) is on one host wherever the hosts' workers allow, its all-reduces then staying on
// the host; each group, in (replica, rank) order, takes the host with the most workers
// left that can hold all of it, else the fullest hosts in turn. `host_of(id)`: a worker's
// host. Returns `chosen` itself for tp <= 1.
std::vector<std::string> GroupByHost(const std::vector<std::string>& chosen, int ranks, int tp,
                                     const std::function<std::string(const std::string&)>& host_of);

class WorkerRegistry {
 public:
  struct Worker {
    WorkerInfo info;   // as ListWorkers shows it
    Device device;     // info.device(), parsed once at registration
    std::shared_ptr<WorkerChannel> channel;
    absl::Time last_heartbeat;
    int attempt = 0;   // the attempt of the job it holds
  };

  // `next_id`: the number the next new worker id takes ("worker-<n>"), kept across
  // restarts by the caller.
  explicit WorkerRegistry(int64_t next_id) : next_id_(std::max<int64_t>(1, next_id)) {}

  // Registers a worker, idle. It keeps the id it had (reg.worker_id(), a worker
  // reconnecting after the coordinator restarted) unless another worker has it now.
  // Returns its id. Errors: INVALID_ARGUMENT for a device that does not parse.
  absl::StatusOr<std::string> Add(const RegisterWorker& reg, std::shared_ptr<WorkerChannel> channel);
  int64_t next_id() const { return next_id_; }

  // The worker, or nullptr.
  Worker* Find(const std::string& id);
  const Worker* Find(const std::string& id) const;
  // Removes it; what it was (nullopt for an unknown id).
  std::optional<Worker> Remove(const std::string& id);

  // It was heard from now.
  void Heard(Worker& w);
  // Workers not heard from within `timeout`, with why.
  std::vector<std::pair<std::string, std::string>> Silent(absl::Time now, absl::Duration timeout) const;

  std::vector<std::string> IdleIds() const;
  int IdleCount() const;
  int size() const { return static_cast<int>(workers_.size()); }
  std::vector<WorkerInfo> List() const;
  const std::map<std::string, Worker>& all() const { return workers_; }

  // Workers for ranks needing `need[g]` bytes of device memory each (by global rank)
  // among the idle ones, or none if they do not fit: a GPU worker takes a rank only if
  // the rank fits the memory it registered; the largest ranks go first, each to the
  // smallest GPU that holds it, else to a CPU worker.
  std::vector<std::string> Fit(const std::vector<int64_t>& need) const;

  // What any job's rank could be given: whether a CPU worker is registered, and the
  // most free memory a GPU worker registered (submissions that no GPU can hold are
  // refused when there are only GPU workers).
  struct Capacity {
    bool any_cpu = false;
    int64_t largest_gpu = 0;
  };
  Capacity capacity() const;

  // The worker holds `rank` of `replica` of `job_id` (its stages) for `attempt`: BUSY.
  void Assign(Worker& w, const std::string& job_id, int attempt, int rank, int replica, const std::vector<int>& stages);
  // It holds nothing: IDLE.
  void Release(Worker& w);

 private:
  int64_t next_id_;
  std::map<std::string, Worker> workers_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_WORKER_REGISTRY_H_
