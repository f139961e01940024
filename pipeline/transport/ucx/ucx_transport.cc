#include "pipeline/transport/ucx/ucx_transport.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "pipeline/transport/completion.h"
#include "pipeline/transport/wire_format.h"

namespace pippy::transport::ucx {
namespace {

using wire::kMaxHeader;
// A waiting caller drives UCX itself for as long as the transfer moves, and blocks once
// UCX has had nothing to do for this long (the peer is computing, not sending): a
// multi-MiB transfer is carried without a thread hand-off, an idle wait does not hog a
// core.
constexpr int kIdleDriveMicros = 1000;
// After a caller stops driving, the background thread leaves the worker to the
// callers for this long unless summoned: an application between two waits (posting
// its next operations) is neither raced for the worker nor preempted by a thread that
// its event fd woke. A caller that blocks, or a send that needs progress while nobody
// waits, summons the thread at once.
constexpr int64_t kCallerGraceNanos = 2'000'000;
// While callers drive, the background thread checks this often whether they still do.
constexpr int64_t kStandAsideNanos = 1'000'000;

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// UCX tag: [sender rank 8][part 1][kind 3][step 12][mb 12][src stage 8][dst stage 8][index 12].
uint64_t UcxTag(int sender, int part, const Tag& t) {
  return (static_cast<uint64_t>(sender) & 0xFF) << 56 | (static_cast<uint64_t>(part) & 1) << 55 |
         (static_cast<uint64_t>(t.kind) & 0x7) << 52 | (static_cast<uint64_t>(t.step) & 0xFFF) << 40 |
         (static_cast<uint64_t>(t.microbatch) & 0xFFF) << 28 | (static_cast<uint64_t>(t.src_stage) & 0xFF) << 20 |
         (static_cast<uint64_t>(t.dst_stage) & 0xFF) << 12 | (static_cast<uint64_t>(t.index) & 0xFFF);
}

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

class Impl;

// One Send or Recv: the Work handed to the caller and the record the progress thread
// keeps until UCX is done with its buffers.
class Op : public CompletionWork, public std::enable_shared_from_this<Op> {
 public:
  Op(Impl* owner, bool is_recv, int self, int peer, const Tag& tag)
      : CompletionWork(self, peer, tag, is_recv), owner_(owner) {}

  // Drives UCX from the waiting thread first (see Op::Wait below).
  absl::Status Wait(absl::Duration timeout) override;
  void Cancel() override;

  // Progress-thread state.
  Impl* owner_;
  std::string header;                    // send: the header (and an inline payload)
  std::unique_ptr<char[]> recv_header;   // receive: kMaxHeader bytes, uninitialised
  std::vector<at::Tensor> tensors;
  std::vector<ucp_dt_iov_t> iov;
  c10::IValue pending_value;
  std::set<void*> requests;  // outstanding UCX requests
  bool payload_posted = false;
  struct Post {
    bool completed = false;  // the callback ran inside ucp_tag_recv_nbx
  };
  Post* posting = nullptr;  // set while a receive of this op is being posted
};

struct EpErrorArg {
  Impl* impl;
  int peer;
};

class Impl : public UcxTransport {
 public:
  Impl(int rank, int n) : rank_(rank), n_(n), dead_(n, false), err_args_(n) {}

  ~Impl() override { Shutdown(); }

  absl::Status Init(const Options& options) {
    // Peer-failure detection on shared memory needs this before ucp_init.
    setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    // UCX warns on stdout about that setting when no shared-memory transport is used.
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_config_read: ", UcsError(s)));
    if (getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) ucp_config_modify(config, "KEEPALIVE_INTERVAL", "200ms");
    for (const auto& [k, v] : options.ucx_config) {
      s = ucp_config_modify(config, k.c_str(), v.c_str());
      if (s != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(absl::StrCat("UCX setting ", k, "=", v, ": ", UcsError(s)));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_init: ", UcsError(s)));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    wp.events = UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV | UCP_WAKEUP_RX | UCP_WAKEUP_TX;
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_worker_create: ", UcsError(s)));
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    s = ucp_worker_get_address(worker_, &addr, &len);
    if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_worker_get_address: ", UcsError(s)));
    address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    s = ucp_worker_get_efd(worker_, &ucx_efd_);
    if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("ucp_worker_get_efd: ", UcsError(s)));
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    for (int fd : {ucx_efd_, wake_fd_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    }
    eps_.assign(n_, nullptr);
    progress_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return n_; }
  std::string address() const override { return address_; }

  absl::Status Connect(const std::vector<std::string>& addresses) override {
    if (static_cast<int>(addresses.size()) != n_) {
      return absl::InvalidArgumentError(absl::StrCat("Connect needs ", n_, " addresses, got ", addresses.size()));
    }
    absl::Status result;
    WithWorker([&] {
      for (int r = 0; r < n_; ++r) {
        err_args_[r] = {this, r};
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.address = reinterpret_cast<const ucp_address_t*>(addresses[r].data());
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep.err_handler.cb = &Impl::OnEndpointError;
        ep.err_handler.arg = &err_args_[r];
        ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[r]);
        if (s != UCS_OK) {
          result = absl::UnavailableError(absl::StrCat("rank ", rank_, ": cannot create a UCX endpoint to rank ", r,
                                                       ": ", UcsError(s)));
          break;
        }
      }
    });
    if (!result.ok()) return result;
    // Hello barrier: wires every endpoint both ways so failures are noticed.
    Tag hello;
    hello.kind = Tag::Kind::kControl;
    std::vector<std::shared_ptr<Work>> works;
    for (int r = 0; r < n_; ++r) {
      if (r == rank_) continue;
      works.push_back(Send(r, hello, c10::IValue(int64_t{rank_})));
      works.push_back(Recv(r, hello));
    }
    std::vector<std::string> missing;
    for (auto& w : works) {
      absl::Status s = w->Wait(connect_timeout_);
      if (!s.ok()) missing.push_back(std::string(s.message()));
    }
    if (!missing.empty()) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", rank_, " could not reach every peer: ",
                                                      absl::StrJoin(missing, "; ")));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) override {
    auto op = std::make_shared<Op>(this, false, rank_, peer, tag);
    if (peer < 0 || peer >= n_) {
      op->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", peer, " (world size ", n_, ")")));
      return op;
    }
    absl::Status enc = wire::EncodeHeader(value, &op->header, &op->tensors);
    for (const at::Tensor& t : op->tensors) {
      if (enc.ok() && !t.device().is_cpu()) enc = absl::InvalidArgumentError("the UCX transport sends CPU tensors");
    }
    if (!enc.ok() || op->header.size() > kMaxHeader) {
      op->Finish(enc.ok() ? absl::InvalidArgumentError("value structure too large for one message") : enc);
      return op;
    }
    size_t payload = 0;
    for (const at::Tensor& t : op->tensors) {
      size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (bytes > 0) op->iov.push_back({t.data_ptr(), bytes});
      payload += bytes;
    }
    if (payload > 0 && payload <= wire::kMaxInlinePayload && op->header.size() + payload <= kMaxHeader) {
      // Small: one message, header and bytes together (wire_format.h).
      wire::AppendInlinePayload(op->tensors, &op->header);
      op->tensors.clear();
      op->iov.clear();
    }
    WithWorker([this, op] { StartSend(op); }, /*wake=*/[op] { return !op->IsCompleted(); });
    return op;
  }

  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override {
    auto op = std::make_shared<Op>(this, true, rank_, peer, tag);
    if (peer < 0 || peer >= n_) {
      op->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", peer, " (world size ", n_, ")")));
      return op;
    }
    // An armed worker's event fd wakes the progress thread when the message arrives.
    WithWorker([this, op] { StartRecv(op); }, /*wake=*/[] { return false; });
    return op;
  }

  size_t operations_in_flight() override {
    absl::MutexLock lock(&worker_mu_);
    return live_.size();
  }

  void CancelOp(const std::shared_ptr<Op>& op) {
    op->Finish(absl::CancelledError(absl::StrCat("rank ", rank_, ": ", op->tag().ToString(), " cancelled")));
    WithWorker([this, op] {
      // Cancelling may complete the request (and erase it) right here: iterate a copy.
      std::set<void*> requests = op->requests;
      for (void* req : requests) ucp_request_cancel(worker_, req);
    });
  }

  std::shared_ptr<Op> Find(Op* raw) {
    auto it = live_.find(raw);
    return it == live_.end() ? nullptr : it->second;
  }

 private:
  // Runs `fn` with the worker lock held (UCX calls and the state below), then makes
  // sure someone keeps progressing: unless a caller drives the worker in Wait(), a
  // sleeping progress thread is woken if `wake` says the operation still needs it.
  void WithWorker(const std::function<void()>& fn, const std::function<bool()>& wake = [] { return true; }) {
    {
      absl::MutexLock lock(&worker_mu_);
      fn();
    }
    if (driving_.load() == 0 && wake()) Summon();
  }

  // Makes the background thread take the worker over now.
  void Summon() {
    takeover_.store(true);
    Wake();
  }

  void Wake() {
    if (sleeping_.load()) {
      uint64_t one = 1;
      (void)!write(wake_fd_, &one, sizeof(one));
    }
  }

 public:
  std::atomic<int> driving_{0};  // callers currently progressing the worker in Wait()
  std::atomic<int64_t> last_drive_end_{0};  // SteadyNanos() when a caller last stopped driving
  std::atomic<bool> takeover_{false};       // the background thread is needed now

  // Progresses the worker once if no other thread is doing it (the caller checks its
  // operation after each round: no extra poll of the sockets before it notices).
  // Returns the number of UCX events handled, or -1 when another thread holds the worker.
  int TryProgress() {
    if (!worker_mu_.TryLock()) return -1;
    const int events = static_cast<int>(ucp_worker_progress(worker_));
    worker_mu_.Unlock();
    return events;
  }

 private:

  // The background progress thread keeps UCX moving when no caller is waiting (sends
  // in flight, keepalive, peer-failure detection). While there is traffic it polls;
  // idle, it sleeps on the worker's event fd (0% CPU). Waiting callers progress the
  // worker themselves, which is what keeps small-message latency low.
  void ProgressLoop() {
    auto last_activity = std::chrono::steady_clock::now();
    while (!stop_.load()) {
      if (driving_.load() > 0) {
        // Callers drive the worker: a second poller (or being woken by the event fd
        // for every message) only steals their CPU. A caller that stops driving before
        // its operation is done summons this thread again.
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
        absl::MutexLock lock(&worker_mu_);
        while (ucp_worker_progress(worker_) != 0) work = true;
      }
      auto now = std::chrono::steady_clock::now();
      if (work) last_activity = now;
      if (driving_.load() == 0 && now - last_activity < std::chrono::microseconds(100)) {
        std::this_thread::yield();
        continue;
      }
      {
        absl::MutexLock lock(&worker_mu_);
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

  // Sleeps on the wake fd alone (not the worker's event fd) for up to `nanos`.
  void StandAside(int64_t nanos) {
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

  ucp_request_param_t Params(Op* op, bool iov) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.user_data = op;
    if (iov) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      p.datatype = ucp_dt_make_iov();
    }
    return p;
  }

  // Records a UCX request; returns false (and fails the op) on an immediate error.
  bool Track(const std::shared_ptr<Op>& op, ucs_status_ptr_t req, const char* what) {
    if (UCS_PTR_IS_ERR(req)) {
      ucs_status_t s = UCS_PTR_STATUS(req);
      op->Finish(PeerStatus(op.get(), s, what));
      Retire(op);
      return false;
    }
    if (req != nullptr) {
      op->requests.insert(req);
      live_[op.get()] = op;
    }
    return true;
  }

  absl::Status PeerStatus(Op* op, ucs_status_t s, const char* what) {
    std::string msg = absl::StrCat("rank ", rank_, ": ", what, " rank ", op->peer(), " (", op->tag().ToString(),
                                   ") failed: ", UcsError(s));
    if (s == UCS_ERR_CANCELED) return absl::CancelledError(msg);
    if (dead_[op->peer()] || s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_CONNECTION_RESET ||
        s == UCS_ERR_UNREACHABLE) {
      return absl::UnavailableError(absl::StrCat("rank ", rank_, ": peer rank ", op->peer(), " is gone (",
                                                 op->tag().ToString(), "): ", UcsError(s)));
    }
    return absl::InternalError(msg);
  }

  void Retire(const std::shared_ptr<Op>& op) {
    if (op->requests.empty()) {
      live_.erase(op.get());
      pending_by_peer_[op->peer()].erase(op.get());
    }
  }

  absl::Status DeadPeer(Op* op) {
    return absl::UnavailableError(absl::StrCat("rank ", rank_, ": peer rank ", op->peer(), " is gone (",
                                               op->tag().ToString(), ")"));
  }

  void StartSend(const std::shared_ptr<Op>& op) {
    if (op->IsCompleted()) return;  // cancelled before it started
    if (eps_[op->peer()] == nullptr) {
      op->Finish(absl::FailedPreconditionError("Send before Connect"));
      return;
    }
    if (dead_[op->peer()]) {
      op->Finish(DeadPeer(op.get()));
      return;
    }
    pending_by_peer_[op->peer()][op.get()] = op;
    live_[op.get()] = op;
    ucp_request_param_t hp = Params(op.get(), false);
    hp.cb.send = &Impl::OnSendDone;
    if (!Track(op, ucp_tag_send_nbx(eps_[op->peer()], op->header.data(), op->header.size(),
                                    UcxTag(rank_, 0, op->tag()), &hp), "send to")) {
      return;
    }
    if (!op->iov.empty()) {
      // One tensor (the usual case): a contiguous buffer, which keeps UCX on its
      // zero-copy rendezvous protocols; several: one scatter-gather (IOV) message.
      const bool single = op->iov.size() == 1;
      ucp_request_param_t pp = Params(op.get(), !single);
      pp.cb.send = &Impl::OnSendDone;
      void* buf = single ? op->iov[0].buffer : static_cast<void*>(op->iov.data());
      size_t count = single ? op->iov[0].length : op->iov.size();
      if (!Track(op, ucp_tag_send_nbx(eps_[op->peer()], buf, count, UcxTag(rank_, 1, op->tag()), &pp), "send to")) {
        return;
      }
    }
    if (op->requests.empty()) {
      op->Finish(absl::OkStatus());
      Retire(op);
    }
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    Op* raw = static_cast<Op*>(user_data);
    Impl* self = raw->owner_;
    std::shared_ptr<Op> op = self->Find(raw);
    ucp_request_free(request);
    if (op == nullptr) return;
    op->requests.erase(request);
    if (status != UCS_OK) op->Finish(self->PeerStatus(raw, status, "send to"));
    if (op->requests.empty()) {
      op->Finish(absl::OkStatus());
      self->Retire(op);
    }
  }

  void StartRecv(const std::shared_ptr<Op>& op) {
    if (op->IsCompleted()) return;
    pending_by_peer_[op->peer()][op.get()] = op;
    live_[op.get()] = op;
    if (spare_headers_.empty()) {
      op->recv_header.reset(new char[kMaxHeader]);
    } else {
      op->recv_header = std::move(spare_headers_.back());
      spare_headers_.pop_back();
    }
    PostRecv(op, 0, op->recv_header.get(), kMaxHeader, false);
    // A peer that is gone may have left this message here before it went (a last rank
    // that sent and exited): UCX matched it above if so. Anything else never comes.
    if (dead_[op->peer()] && !op->IsCompleted()) Abandon(op);
  }

  // Posts the receive of one part of op's message. Completion always goes through
  // OnRecvDone, which gets the received length (UCX 1.13 leaves recv_info unset when
  // a receive completes at once). For a message that is already here, UCX calls it
  // inside ucp_tag_recv_nbx and then returns the (by then freed) request: `post`
  // records that, so the request is not tracked.
  void PostRecv(const std::shared_ptr<Op>& op, int part, void* buf, size_t count, bool iov) {
    ucp_request_param_t p = Params(op.get(), iov);
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &Impl::OnRecvDone;
    Op::Post post;
    Op::Post* outer = op->posting;  // the header's post, when its callback posts the payload
    op->posting = &post;
    ucs_status_ptr_t req = ucp_tag_recv_nbx(worker_, buf, count, UcxTag(op->peer(), part, op->tag()), ~uint64_t{0}, &p);
    op->posting = outer;
    if (!post.completed) Track(op, req, "receive from");
  }

  static void OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
    Op* raw = static_cast<Op*>(user_data);
    Impl* self = raw->owner_;
    std::shared_ptr<Op> op = self->Find(raw);
    ucp_request_free(request);
    if (op == nullptr) return;
    if (op->posting != nullptr) op->posting->completed = true;
    op->requests.erase(request);
    self->OnReceived(op, status, status == UCS_OK ? info->length : 0);
  }

  void OnReceived(const std::shared_ptr<Op>& op, ucs_status_t status, size_t length) {
    if (status != UCS_OK) {
      op->Finish(PeerStatus(op.get(), status, "receive from"));
      Retire(op);
      return;
    }
    if (!op->payload_posted) {
      OnHeader(op, length);
      return;
    }
    size_t expected = 0;
    for (const ucp_dt_iov_t& v : op->iov) expected += v.length;
    if (length != expected) {
      op->Finish(absl::DataLossError(absl::StrCat("rank ", rank_, ": rank ", op->peer(), " sent ", length,
                                                  " payload bytes where its header described ", expected, " (",
                                                  op->tag().ToString(), ")")));
    } else {
      op->Finish(absl::OkStatus(), op->pending_value);
    }
    Retire(op);
  }

  void OnHeader(const std::shared_ptr<Op>& op, size_t length) {
    bool inline_payload = false;
    auto decoded = wire::DecodeHeader(
        op->recv_header.get(), length,
        [this](const std::vector<int64_t>& sizes, c10::ScalarType dtype) { return AllocateReceive(sizes, dtype); },
        &op->tensors, &inline_payload);
    // Header buffers are reused: allocating and freeing 64 KiB per message costs
    // glibc a heap consolidation each time.
    if (spare_headers_.size() < 64) spare_headers_.push_back(std::move(op->recv_header));
    op->recv_header.reset();
    c10::IValue value = decoded.ok() ? *decoded : c10::IValue();
    if (!decoded.ok()) {
      op->Finish(absl::DataLossError(absl::StrCat("rank ", rank_, ": malformed message from rank ", op->peer(), " (",
                                                  op->tag().ToString(), "): ", decoded.status().message())));
      Retire(op);
      return;
    }
    if (inline_payload) {
      op->Finish(absl::OkStatus(), value);
      Retire(op);
      return;
    }
    op->pending_value = value;
    for (const at::Tensor& t : op->tensors) {
      size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (bytes > 0) op->iov.push_back({t.data_ptr(), bytes});
    }
    if (op->iov.empty()) {
      op->Finish(absl::OkStatus(), value);
      Retire(op);
      return;
    }
    op->payload_posted = true;
    const bool single = op->iov.size() == 1;
    void* buf = single ? op->iov[0].buffer : static_cast<void*>(op->iov.data());
    size_t count = single ? op->iov[0].length : op->iov.size();
    PostRecv(op, 1, buf, count, !single);
  }

  // Receive buffers: a fresh 64 MiB tensor costs page faults (~2 GB/s), so buffers
  // are reused once nothing but the pool references their storage.
  at::Tensor AllocateReceive(const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
    const auto options = at::TensorOptions().dtype(dtype);
    int64_t numel = 1;
    for (int64_t d : sizes) numel *= d;
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    if (nbytes < (64 << 10)) return at::empty(sizes, options);  // small: the allocator is fast
    auto& bucket = pool_[nbytes];
    for (at::Tensor& buf : bucket) {
      if (buf.storage().use_count() == 1) return buf.view(dtype).view(sizes);
    }
    at::Tensor buf = at::empty({nbytes}, at::kByte);
    if (bucket.size() < 32 && pool_bytes_ + nbytes <= (int64_t{2} << 30)) {
      bucket.push_back(buf);
      pool_bytes_ += nbytes;
    }
    return buf.view(dtype).view(sizes);
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* a = static_cast<EpErrorArg*>(arg);
    a->impl->FailPeer(a->peer, status);
  }

  void FailPeer(int peer, ucs_status_t status) {
    if (dead_[peer]) return;
    dead_[peer] = true;
    log::Warn("rank={} UCX endpoint to rank {} failed: {}", rank_, peer, UcsError(status));
    auto ops = pending_by_peer_[peer];
    for (auto& [raw, op] : ops) Abandon(op);
  }

  // Fails an operation with a peer that is gone and gives its buffers back from UCX.
  void Abandon(const std::shared_ptr<Op>& op) {
    op->Finish(DeadPeer(op.get()));
    std::set<void*> requests = op->requests;  // cancelling may complete (and erase) them
    for (void* req : requests) ucp_request_cancel(worker_, req);
  }

  void Shutdown() {
    if (worker_ == nullptr) return;
    if (progress_.joinable()) {
      stop_.store(true);
      sleeping_.store(true);
      uint64_t one = 1;
      (void)!write(wake_fd_, &one, sizeof(one));
      progress_.join();
    }
    for (auto& [raw, op] : live_) {
      op->Finish(absl::UnavailableError(absl::StrCat("rank ", rank_, ": transport shut down")));
    }
    // A completed Send only means UCX has the bytes (for tcp, maybe still in its send
    // buffer): endpoints to live peers with nothing pending are flushed first, so that
    // what was sent arrives (bounded: 2 s for all of them). Then every endpoint is
    // closed by force — a flush could wait forever on sends the peer will never take,
    // and UCX aborts when a worker is destroyed under a close still in progress.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    auto progress_until_done = [&](ucs_status_ptr_t req, bool bounded_by_deadline) {
      for (int i = 0; UCS_PTR_IS_PTR(req) && ucp_request_check_status(req) == UCS_INPROGRESS; ++i) {
        if (bounded_by_deadline ? std::chrono::steady_clock::now() >= deadline : i >= 1000) break;
        ucp_worker_progress(worker_);
      }
    };
    for (int r = 0; r < n_; ++r) {
      if (eps_.size() <= static_cast<size_t>(r) || eps_[r] == nullptr) continue;
      ucp_request_param_t p{};
      ucs_status_ptr_t flush = nullptr;
      if (!dead_[r] && pending_by_peer_[r].empty()) {
        flush = ucp_ep_flush_nbx(eps_[r], &p);
        progress_until_done(flush, true);
      }
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t close = ucp_ep_close_nbx(eps_[r], &p);
      progress_until_done(close, false);
      if (UCS_PTR_IS_PTR(flush)) ucp_request_free(flush);
      if (UCS_PTR_IS_PTR(close)) ucp_request_free(close);
    }
    live_.clear();
    pending_by_peer_.clear();
    pool_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
  }

  const int rank_, n_;
  absl::Duration connect_timeout_ = absl::Seconds(30);
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int ucx_efd_ = -1, wake_fd_ = -1, epoll_fd_ = -1;
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  // Held for every UCX call and for the state below (callbacks run under it too).
  absl::Mutex worker_mu_;
  std::vector<ucp_ep_h> eps_;
  std::vector<bool> dead_;
  std::vector<EpErrorArg> err_args_;
  std::map<Op*, std::shared_ptr<Op>> live_;
  std::map<int, std::map<Op*, std::shared_ptr<Op>>> pending_by_peer_;
  std::map<int64_t, std::vector<at::Tensor>> pool_;
  std::vector<std::unique_ptr<char[]>> spare_headers_;  // kMaxHeader bytes each
  int64_t pool_bytes_ = 0;

  friend class Op;
};

absl::Status Op::Wait(absl::Duration timeout) {
  // Drive UCX from this thread while the transfer moves (as ucx_perftest does): no
  // thread hand-off on the critical path. Then block; the progress thread carries on.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24)));
  auto last_event = start;
  bool active = false;
  owner_->driving_.fetch_add(1);
  for (uint32_t round = 1; !IsCompleted(); ++round) {
    const int events = owner_->TryProgress();
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
  owner_->last_drive_end_.store(SteadyNanos());
  owner_->driving_.fetch_sub(1);
  if (IsCompleted()) return CompletionWork::Wait(timeout);
  owner_->Summon();  // about to block: the progress thread takes over
  return WaitRest(timeout - absl::FromChrono(std::chrono::steady_clock::now() - start), timeout);
}

void Op::Cancel() {
  if (IsCompleted()) return;
  owner_->CancelOp(shared_from_this());
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(int rank, int world_size, const Options& options) {
  if (world_size < 1 || world_size > 256 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", world_size, ": the UCX transport supports 1..256 ranks"));
  }
#ifdef NDEBUG
  // Debian's Abseil is built with Mutex deadlock detection on (its debug default); it
  // costs a small message ~10% of its CPU. Release builds of pippy turn it off, as
  // Abseil's own release default would.
  static std::once_flag once;
  std::call_once(once, [] { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); });
#endif
  auto impl = std::make_unique<Impl>(rank, world_size);
  absl::Status s = impl->Init(options);
  if (!s.ok()) return s;
  return std::unique_ptr<UcxTransport>(std::move(impl));
}

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLocalGroup(int n, const Options& options) {
  std::vector<std::unique_ptr<UcxTransport>> group;
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    auto t = UcxTransport::Create(r, n, options);
    if (!t.ok()) return t.status();
    addresses.push_back((*t)->address());
    group.push_back(std::move(*t));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(n);
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { results[r] = group[r]->Connect(addresses); });
  for (auto& t : threads) t.join();
  for (const auto& s : results) {
    if (!s.ok()) return s;
  }
  std::vector<std::unique_ptr<Transport>> out;
  for (auto& t : group) out.push_back(std::move(t));
  return out;
}

}  // namespace pippy::transport::ucx
