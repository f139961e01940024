#include "pipeline/transport/ucx/progress.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace pippy::transport::ucx {
namespace {

// A waiting caller drives UCX itself for as long as the transfer moves, and blocks once
// UCX has had nothing to do for this long (the peer is computing, not sending): a
// multi-MiB transfer is carried without a thread hand-off, an idle wait does not hog a
// core.
constexpr int kIdleDriveMicros = 1000;
// After a caller stops driving, the background thread leaves the worker to the
// callers for this long unless summoned: an application between two waits (posting
// its next operations) is neither raced for the worker nor preempted by a thread that
// its event fd woke.
constexpr int64_t kCallerGraceNanos = 2'000'000;
// While callers drive, the background thread checks this often whether they still do.
constexpr int64_t kStandAsideNanos = 1'000'000;

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

absl::Status ProgressEngine::Start() {
  ucs_status_t s = ucp_worker_get_efd(worker_, &ucx_efd_);
  if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_worker_get_efd: ", ucs_status_string(s)));
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) return absl::UnavailableError("cannot create the progress thread's event fds");
  for (int fd : {ucx_efd_, wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void ProgressEngine::Stop() {
  if (thread_.joinable()) {
    stop_.store(true);
    sleeping_.store(true);
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  wake_fd_ = epoll_fd_ = -1;
}

void ProgressEngine::AfterPosting(bool needs_progress) {
  if (driving_.load() == 0 && needs_progress) Summon();
}

void ProgressEngine::Summon() {
  takeover_.store(true);
  Wake();
}

void ProgressEngine::Wake() {
  if (sleeping_.load()) {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
}

int ProgressEngine::TryProgress() {
  if (!worker_mu_->TryLock()) return -1;
  const int events = static_cast<int>(ucp_worker_progress(worker_));
  worker_mu_->Unlock();
  return events;
}

bool ProgressEngine::Drive(const std::function<bool()>& done, absl::Duration timeout, absl::Duration* elapsed) {
  // Drive UCX from this thread while the transfer moves (as ucx_perftest does).
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24)));
  auto last_event = start;
  bool active = false;
  driving_.fetch_add(1);
  for (uint32_t round = 1; !done(); ++round) {
    const int events = TryProgress();
    if (events > 0) active = true;
    if (events < 0) std::this_thread::yield();  // another caller drives
    // A round on shared memory takes ~50 ns; reading the clock (slow on VMs) every
    // round would cost more than the progress itself.
    if (round % 32 != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    if (active) last_event = now;
    active = false;
    if (now - last_event > std::chrono::microseconds(kIdleDriveMicros) || now >= deadline) break;
  }
  const int64_t end = SteadyNanos();
  last_drive_end_.store(end);
  driving_.fetch_sub(1);
  *elapsed = absl::Nanoseconds(end - std::chrono::duration_cast<std::chrono::nanoseconds>(start.time_since_epoch()).count());
  if (done()) return true;
  Summon();  // the caller is about to block: the progress thread takes over
  return false;
}

void ProgressEngine::Loop() {
  auto last_activity = std::chrono::steady_clock::now();
  while (!stop_.load()) {
    if (driving_.load() > 0) {
      // Callers drive the worker: a second poller (or being woken by the event fd for
      // every message) only steals their CPU. A caller that stops driving before its
      // operation is done summons this thread again.
      takeover_.store(false);
      StandAside(kStandAsideNanos);
      last_activity = std::chrono::steady_clock::now();
      continue;
    }
    const int64_t grace_left = last_drive_end_.load() + kCallerGraceNanos - SteadyNanos();
    if (grace_left > 0 && !takeover_.load()) {
      // Callers drove it a moment ago and are likely to again.
      StandAside(std::min(grace_left, kStandAsideNanos));
      last_activity = std::chrono::steady_clock::now();
      continue;
    }
    takeover_.store(false);
    bool work = false;
    {
      absl::MutexLock lock(worker_mu_);
      while (ucp_worker_progress(worker_) != 0) work = true;
    }
    auto now = std::chrono::steady_clock::now();
    if (work) last_activity = now;
    if (driving_.load() == 0 && now - last_activity < std::chrono::microseconds(100)) {
      std::this_thread::yield();
      continue;
    }
    {
      absl::MutexLock lock(worker_mu_);
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      sleeping_.store(true);
    }
    epoll_event events[2];
    int n = epoll_wait(epoll_fd_, events, 2, 50);
    sleeping_.store(false);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_) {
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof(v));
      }
    }
    last_activity = std::chrono::steady_clock::now();
  }
}

void ProgressEngine::StandAside(int64_t nanos) {
  sleeping_.store(true);
  if (!stop_.load() && !takeover_.load()) {
    pollfd p{wake_fd_, POLLIN, 0};
    timespec ts{static_cast<time_t>(nanos / 1'000'000'000), static_cast<long>(nanos % 1'000'000'000)};
    if (ppoll(&p, 1, &ts, nullptr) > 0) {
      uint64_t v;
      (void)!read(wake_fd_, &v, sizeof(v));
    }
  }
  sleeping_.store(false);
}

}  // namespace pippy::transport::ucx
