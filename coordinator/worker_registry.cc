#include "coordinator/worker_registry.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pippy::coordinator {

absl::StatusOr<std::string> WorkerRegistry::Add(const RegisterWorker& reg, std::shared_ptr<WorkerChannel> channel) {
  // Unset: a CPU worker (what a worker registers without --device).
  absl::StatusOr<Device> device = ParseDevice(reg.device().empty() ? "cpu" : reg.device());
  if (!device.ok() || device->kind == Device::Kind::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat("register.device: '", reg.device(), "' is not a device a worker ",
                                                   "runs on (cpu or cuda:N); is the worker (", reg.version(),
                                                   ") of this coordinator's version?"));
  }
  // A worker that reconnects (after a restart of the coordinator or a broken stream)
  // keeps its id unless another worker has it now.
  std::string id;
  int64_t n = 0;
  if (!reg.worker_id().empty() && !workers_.count(reg.worker_id()) &&
      sscanf(reg.worker_id().c_str(), "worker-%ld", &n) == 1 && reg.worker_id() == absl::StrCat("worker-", n)) {
    id = reg.worker_id();
    next_id_ = std::max(next_id_, n + 1);
  } else {
    id = absl::StrCat("worker-", next_id_++);
  }
  Worker w;
  w.info.set_worker_id(id);
  w.info.set_name(reg.name().empty() ? id : reg.name());
  w.info.set_host(reg.host());
  w.info.set_device(device->ToString());
  w.info.set_free_memory(reg.free_memory());
  w.info.set_device_name(reg.device_name());
  w.info.set_version(reg.version());
  w.info.set_threads(reg.threads());
  w.info.set_host_cpus(reg.host_cpus());
  w.info.set_state(IDLE);
  w.device = *device;
  w.channel = std::move(channel);
  Heard(w);
  log::Info("worker {} ({}) {}", id, w.info.name(), id == reg.worker_id() ? "registered again" : "registered");
  workers_[id] = std::move(w);
  return id;
}

WorkerRegistry::Worker* WorkerRegistry::Find(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

const WorkerRegistry::Worker* WorkerRegistry::Find(const std::string& id) const {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

std::optional<WorkerRegistry::Worker> WorkerRegistry::Remove(const std::string& id) {
  auto it = workers_.find(id);
  if (it == workers_.end()) return std::nullopt;
  Worker w = std::move(it->second);
  workers_.erase(it);
  return w;
}

void WorkerRegistry::Heard(Worker& w) {
  w.last_heartbeat = absl::Now();
  w.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(w.last_heartbeat));
}

std::vector<std::pair<std::string, std::string>> WorkerRegistry::Silent(absl::Time now,
                                                                        absl::Duration timeout) const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [id, w] : workers_) {
    if (now - w.last_heartbeat > timeout) {
      out.emplace_back(id, absl::StrCat("stopped sending heartbeats (none for ",
                                        absl::FormatDuration(now - w.last_heartbeat), ")"));
    }
  }
  return out;
}

std::vector<std::string> WorkerRegistry::IdleIds() const {
  std::vector<std::string> idle;
  for (const auto& [id, w] : workers_) {
    if (w.info.state() == IDLE) idle.push_back(id);
  }
  return idle;
}

int WorkerRegistry::IdleCount() const {
  int n = 0;
  for (const auto& [id, w] : workers_) n += w.info.state() == IDLE ? 1 : 0;
  return n;
}

std::vector<WorkerInfo> WorkerRegistry::List() const {
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) out.push_back(w.info);
  return out;
}

std::vector<std::string> GroupByHost(const std::vector<std::string>& chosen, int ranks, int tp,
                                     const std::function<std::string(const std::string&)>& host_of) {
  if (tp <= 1 || ranks <= 0 || chosen.size() % static_cast<size_t>(ranks * tp) != 0) return chosen;
  std::map<std::string, std::vector<std::string>> left;  // host -> its workers, in chosen order
  for (const std::string& id : chosen) left[host_of(id)].push_back(id);
  auto take = [&left](const std::string& host) {
    std::vector<std::string>& ids = left[host];
    std::string id = ids.front();
    ids.erase(ids.begin());
    return id;
  };
  std::vector<std::string> out(chosen.size());
  const int replicas = static_cast<int>(chosen.size()) / (ranks * tp);
  for (int replica = 0; replica < replicas; ++replica) {
    for (int rank = 0; rank < ranks; ++rank) {
      std::string whole;  // the host with the most workers left that holds the whole group
      for (const auto& [host, ids] : left) {
        if (static_cast<int>(ids.size()) >= tp && (whole.empty() || ids.size() > left[whole].size())) whole = host;
      }
      for (int t = 0; t < tp; ++t) {
        std::string host = whole;
        if (host.empty()) {  // no host holds it: the fullest host, each time
          for (const auto& [h, ids] : left) {
            if (!ids.empty() && (host.empty() || ids.size() > left[host].size())) host = h;
          }
        }
        out[static_cast<size_t>((replica * tp + t) * ranks + rank)] = take(host);
      }
    }
  }
  return out;
}

std::vector<std::string> WorkerRegistry::Fit(const std::vector<int64_t>& need) const {
  std::vector<std::string> free = IdleIds();
  if (need.empty() || free.size() < need.size()) return {};
  std::vector<size_t> order(need.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return need[a] > need[b]; });
  std::vector<std::string> chosen(need.size());
  for (size_t g : order) {
    int best = -1;
    for (size_t k = 0; k < free.size(); ++k) {
      const Worker& w = workers_.at(free[k]);
      if (!w.device.is_gpu()) {
        if (best < 0) best = static_cast<int>(k);
        continue;
      }
      if (w.info.free_memory() < need[g]) continue;
      const Worker* b = best < 0 ? nullptr : &workers_.at(free[static_cast<size_t>(best)]);
      if (b == nullptr || !b->device.is_gpu() || w.info.free_memory() < b->info.free_memory()) {
        best = static_cast<int>(k);
      }
    }
    if (best < 0) return {};
    chosen[g] = free[static_cast<size_t>(best)];
    free.erase(free.begin() + best);
  }
  return chosen;
}

WorkerRegistry::Capacity WorkerRegistry::capacity() const {
  Capacity c;
  for (const auto& [id, w] : workers_) {
    if (w.device.is_gpu()) {
      c.largest_gpu = std::max(c.largest_gpu, w.info.free_memory());
    } else {
      c.any_cpu = true;
    }
  }
  return c;
}

void WorkerRegistry::Assign(Worker& w, const std::string& job_id, int attempt, int rank, int replica,
                            const std::vector<int>& stages) {
  w.attempt = attempt;
  w.info.set_state(BUSY);
  w.info.set_job_id(job_id);
  w.info.set_rank(rank);
  w.info.set_replica(replica);
  w.info.clear_stages();
  for (int s : stages) w.info.add_stages(s);
  w.info.set_bytes_received(0);
  w.info.set_loaded_param_bytes(0);
}

void WorkerRegistry::Release(Worker& w) {
  w.info.set_state(IDLE);
  w.info.clear_job_id();
}

}  // namespace pippy::coordinator
