#include "pipeline/transport/ucx/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <chrono>
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
#include "pipeline/transport/ucx/progress.h"
#include "pipeline/transport/ucx/receive_pool.h"
#include "pipeline/transport/wire_format.h"

// The protocol (docs/wire_protocol.md): each Send is a header message (part 0) and,
// unless the payload travels inline with it, one payload message (part 1) with the
// same tag; a Recv posts the header's receive, decodes it, allocates the tensors and
// posts the payload's receive into them. Who drives UCX is progress.h's business,
// where receive buffers come from receive_pool.h's.

namespace pippy::transport::ucx {
namespace {

using wire::kMaxHeader;

// UCX tag: [sender rank 8][part 1][kind 3][step 12][mb 12][src stage 8][dst stage 8][index 12].
uint64_t UcxTag(int sender, int part, const Tag& t) {
  return (static_cast<uint64_t>(sender) & 0xFF) << 56 | (static_cast<uint64_t>(part) & 1) << 55 |
         (static_cast<uint64_t>(t.kind) & 0x7) << 52 | (static_cast<uint64_t>(t.step) & 0xFFF) << 40 |
         (static_cast<uint64_t>(t.microbatch) & 0xFFF) << 28 | (static_cast<uint64_t>(t.src_stage) & 0xFF) << 20 |
         (static_cast<uint64_t>(t.dst_stage) & 0xFF) << 12 | (static_cast<uint64_t>(t.index) & 0xFFF);
}

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

class Impl;

// One Send or Recv: the Work handed to the caller and the record the protocol keeps
// until UCX is done with its buffers. Its protocol state is guarded by the owning
// transport's worker lock (the same for every Op of a transport).
class Op : public CompletionWork, public std::enable_shared_from_this<Op> {
 public:
  Op(Impl* owner, absl::Mutex* worker_mu, bool is_recv, int self, int peer, const Tag& tag)
      : CompletionWork(self, peer, tag, is_recv), owner_(owner), worker_mu_(worker_mu) {}

  // Drives UCX from the waiting thread first (ProgressEngine::Drive), then blocks.
  absl::Status Wait(absl::Duration timeout) override;
  void Cancel() override;

  // Tells the analysis that the lock is held where UCX runs callbacks (inside
  // ucp_worker_progress, which is only called with it held).
  void AssertWorkerHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(worker_mu_) { worker_mu_->AssertHeld(); }

  Impl* const owner_;
  absl::Mutex* const worker_mu_;
  std::string header ABSL_GUARDED_BY(worker_mu_);                    // send: the header (and an inline payload)
  std::unique_ptr<char[]> recv_header ABSL_GUARDED_BY(worker_mu_);   // receive: kMaxHeader bytes
  std::vector<at::Tensor> tensors ABSL_GUARDED_BY(worker_mu_);
  std::vector<ucp_dt_iov_t> iov ABSL_GUARDED_BY(worker_mu_);
  c10::IValue pending_value ABSL_GUARDED_BY(worker_mu_);
  std::set<void*> requests ABSL_GUARDED_BY(worker_mu_);  // outstanding UCX requests
  bool payload_posted ABSL_GUARDED_BY(worker_mu_) = false;
  struct Post {
    bool completed = false;  // the callback ran inside ucp_tag_recv_nbx
  };
  Post* posting ABSL_GUARDED_BY(worker_mu_) = nullptr;  // set while a receive of this op is being posted
};

struct EpErrorArg {
  Impl* impl;
  int peer;
};

class Impl : public UcxTransport {
 public:
  Impl(int rank, int n, const Options& options)
      : rank_(rank), n_(n), err_args_(n), receive_pool_(options.receive_buffer) {}

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
    progress_ = std::make_unique<ProgressEngine>(worker_, &worker_mu_);
    {
      absl::MutexLock lock(&worker_mu_);
      eps_.assign(n_, nullptr);
      dead_.assign(n_, false);
    }
    return progress_->Start();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return n_; }
  std::string address() const override { return address_; }

  absl::Status Connect(const std::vector<std::string>& addresses) override {
    if (static_cast<int>(addresses.size()) != n_) {
      return absl::InvalidArgumentError(absl::StrCat("Connect needs ", n_, " addresses, got ", addresses.size()));
    }
    absl::Status result;
    {
      absl::MutexLock lock(&worker_mu_);
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
    }
    progress_->AfterPosting(true);
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
    auto op = std::make_shared<Op>(this, &worker_mu_, false, rank_, peer, tag);
    if (peer < 0 || peer >= n_) {
      op->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", peer, " (world size ", n_, ")")));
      return op;
    }
    // Encoded before the lock: only this thread knows the op yet.
    std::string header;
    std::vector<at::Tensor> tensors;
    absl::Status enc = wire::EncodeHeader(value, &header, &tensors);
    for (const at::Tensor& t : tensors) {
      if (enc.ok() && !t.device().is_cpu()) enc = absl::InvalidArgumentError("the UCX transport sends CPU tensors");
    }
    if (!enc.ok() || header.size() > kMaxHeader) {
      op->Finish(enc.ok() ? absl::InvalidArgumentError("value structure too large for one message") : enc);
      return op;
    }
    std::vector<ucp_dt_iov_t> iov;
    size_t payload = 0;
    for (const at::Tensor& t : tensors) {
      size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (bytes > 0) iov.push_back({t.data_ptr(), bytes});
      payload += bytes;
    }
    if (payload > 0 && payload <= wire::kMaxInlinePayload && header.size() + payload <= kMaxHeader) {
      // Small: one message, header and bytes together (wire_format.h).
      wire::AppendInlinePayload(tensors, &header);
      tensors.clear();
      iov.clear();
    }
    {
      absl::MutexLock lock(&worker_mu_);
      op->AssertWorkerHeld();
      op->header = std::move(header);
      op->tensors = std::move(tensors);
      op->iov = std::move(iov);
      StartSend(op);
    }
    progress_->AfterPosting(!op->IsCompleted());
    return op;
  }

  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override {
    auto op = std::make_shared<Op>(this, &worker_mu_, true, rank_, peer, tag);
    if (peer < 0 || peer >= n_) {
      op->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", peer, " (world size ", n_, ")")));
      return op;
    }
    // An armed worker's event fd wakes the progress thread when the message arrives.
    absl::MutexLock lock(&worker_mu_);
    StartRecv(op);
    return op;
  }

  size_t operations_in_flight() override {
    absl::MutexLock lock(&worker_mu_);
    return live_.size();
  }

  void CancelOp(const std::shared_ptr<Op>& op) {
    op->Finish(absl::CancelledError(absl::StrCat("rank ", rank_, ": ", op->tag().ToString(), " cancelled")));
    {
      absl::MutexLock lock(&worker_mu_);
      op->AssertWorkerHeld();
      // Cancelling may complete the request (and erase it) right here: iterate a copy.
      std::set<void*> requests = op->requests;
      for (void* req : requests) ucp_request_cancel(worker_, req);
    }
    progress_->AfterPosting(true);
  }

  ProgressEngine& progress() { return *progress_; }

 private:
  std::shared_ptr<Op> Find(Op* raw) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    auto it = live_.find(raw);
    return it == live_.end() ? nullptr : it->second;
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
  bool Track(const std::shared_ptr<Op>& op, ucs_status_ptr_t req, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
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

  absl::Status PeerStatus(Op* op, ucs_status_t s, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
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

  void Retire(const std::shared_ptr<Op>& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
    if (op->requests.empty()) {
      live_.erase(op.get());
      pending_by_peer_[op->peer()].erase(op.get());
    }
  }

  absl::Status DeadPeer(Op* op) {
    return absl::UnavailableError(absl::StrCat("rank ", rank_, ": peer rank ", op->peer(), " is gone (",
                                               op->tag().ToString(), ")"));
  }

  void StartSend(const std::shared_ptr<Op>& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
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
    self->worker_mu_.AssertHeld();  // UCX runs callbacks inside ucp_worker_progress
    std::shared_ptr<Op> op = self->Find(raw);
    ucp_request_free(request);
    if (op == nullptr) return;
    op->AssertWorkerHeld();
    op->requests.erase(request);
    if (status != UCS_OK) op->Finish(self->PeerStatus(raw, status, "send to"));
    if (op->requests.empty()) {
      op->Finish(absl::OkStatus());
      self->Retire(op);
    }
  }

  void StartRecv(const std::shared_ptr<Op>& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
    if (op->IsCompleted()) return;
    pending_by_peer_[op->peer()][op.get()] = op;
    live_[op.get()] = op;
    op->recv_header = headers_.Take();
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
  void PostRecv(const std::shared_ptr<Op>& op, int part, void* buf, size_t count, bool iov)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
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
    self->worker_mu_.AssertHeld();  // UCX runs callbacks inside ucp_worker_progress
    std::shared_ptr<Op> op = self->Find(raw);
    ucp_request_free(request);
    if (op == nullptr) return;
    op->AssertWorkerHeld();
    if (op->posting != nullptr) op->posting->completed = true;
    op->requests.erase(request);
    self->OnReceived(op, status, status == UCS_OK ? info->length : 0);
  }

  void OnReceived(const std::shared_ptr<Op>& op, ucs_status_t status, size_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
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

  void OnHeader(const std::shared_ptr<Op>& op, size_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
    bool inline_payload = false;
    auto decoded = wire::DecodeHeader(
        op->recv_header.get(), length,
        [this](const std::vector<int64_t>& sizes, c10::ScalarType dtype) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return receive_pool_.Allocate(sizes, dtype);  // called right here, under the worker lock
        },
        &op->tensors, &inline_payload);
    headers_.Give(std::move(op->recv_header));
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

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* a = static_cast<EpErrorArg*>(arg);
    a->impl->worker_mu_.AssertHeld();  // UCX runs callbacks inside ucp_worker_progress
    a->impl->FailPeer(a->peer, status);
  }

  void FailPeer(int peer, ucs_status_t status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    if (dead_[peer]) return;
    dead_[peer] = true;
    log::Warn("rank={} UCX endpoint to rank {} failed: {}", rank_, peer, UcsError(status));
    auto ops = pending_by_peer_[peer];
    for (auto& [raw, op] : ops) Abandon(op);
  }

  // Fails an operation with a peer that is gone and gives its buffers back from UCX.
  void Abandon(const std::shared_ptr<Op>& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_) {
    op->AssertWorkerHeld();
    op->Finish(DeadPeer(op.get()));
    std::set<void*> requests = op->requests;  // cancelling may complete (and erase) them
    for (void* req : requests) ucp_request_cancel(worker_, req);
  }

  void Shutdown() {
    if (worker_ == nullptr) return;
    if (progress_ != nullptr) progress_->Stop();
    absl::MutexLock lock(&worker_mu_);
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
    receive_pool_.Clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    ucp_cleanup(context_);
  }

  const int rank_, n_;
  absl::Duration connect_timeout_ = absl::Seconds(30);
  // Set by Init, then constant.
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::unique_ptr<ProgressEngine> progress_;
  // Held for every UCX call and for the state below; UCX's callbacks run under it.
  absl::Mutex worker_mu_;
  std::vector<ucp_ep_h> eps_ ABSL_GUARDED_BY(worker_mu_);
  std::vector<bool> dead_ ABSL_GUARDED_BY(worker_mu_);
  std::vector<EpErrorArg> err_args_ ABSL_GUARDED_BY(worker_mu_);
  std::map<Op*, std::shared_ptr<Op>> live_ ABSL_GUARDED_BY(worker_mu_);
  std::map<int, std::map<Op*, std::shared_ptr<Op>>> pending_by_peer_ ABSL_GUARDED_BY(worker_mu_);
  ReceivePool receive_pool_ ABSL_GUARDED_BY(worker_mu_);
  HeaderPool headers_ ABSL_GUARDED_BY(worker_mu_){kMaxHeader};

  friend class Op;
};

absl::Status Op::Wait(absl::Duration timeout) {
  absl::Duration elapsed;
  if (owner_->progress().Drive([this] { return IsCompleted(); }, timeout, &elapsed)) {
    return CompletionWork::Wait(timeout);
  }
  return WaitRest(timeout - elapsed, timeout);
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
  auto impl = std::make_unique<Impl>(rank, world_size, options);
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
