// Who moves a UCX worker forward, and when (docs/threading.md).
//
// A caller waiting for its operation drives the worker itself for as long as the
// transfer moves (no thread hand-off on the critical path) and blocks once UCX has had
// nothing to do for 1 ms. A background progress thread keeps UCX moving when nobody
// waits (sends in flight, keepalive, peer-failure detection): while callers drive, and
// for 2 ms after, it stands aside, sleeping on its wake fd only; a caller that blocks,
// or a send that needs progress while nobody drives, summons it at once. Idle, it
// sleeps on the worker's event fd (ucp_worker_arm), so an idle transport costs no CPU.
//
// Thread safety: every method may be called from any thread. Every UCX call on the
// worker happens with `worker_mu` held (given at construction, owned by the caller),
// including the callbacks UCX runs inside ucp_worker_progress.
#ifndef PIPPY_PIPELINE_TRANSPORT_UCX_PROGRESS_H_
#define PIPPY_PIPELINE_TRANSPORT_UCX_PROGRESS_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <functional>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pippy::transport::ucx {

class ProgressEngine {
 public:
  // `worker_mu` guards every call into `worker`; both outlive the engine.
  ProgressEngine(ucp_worker_h worker, absl::Mutex* worker_mu) : worker_(worker), worker_mu_(worker_mu) {}
  ~ProgressEngine() { Stop(); }

  // Opens the event fds and starts the background thread.
  // Errors: UNAVAILABLE with UCX's message.
  absl::Status Start();
  // Stops and joins the background thread (idempotent).
  void Stop();

  // Called after posting operations (with the worker lock released): unless a caller
  // drives the worker, a sleeping progress thread is summoned when `needs_progress`
  // (a send UCX has not completed yet; receives wake it through the event fd).
  void AfterPosting(bool needs_progress);

  // For a caller about to wait for an operation: progresses the worker from this
  // thread until `done()`, or until UCX has been idle for 1 ms, or `timeout` passed.
  // Returns whether `done()` held (if not, the background thread has been summoned to
  // carry on) and sets `*elapsed`. Reads the clock once per 32 rounds: on VMs a clock
  // read costs more than a round of shared-memory progress.
  bool Drive(const std::function<bool()>& done, absl::Duration timeout, absl::Duration* elapsed);

  // Makes the background thread take the worker over now.
  void Summon();

 private:
  void Loop();
  // Sleeps on the wake fd alone (not the worker's event fd) for up to `nanos`.
  void StandAside(int64_t nanos);
  void Wake();
  // One round of progress if no other thread holds the worker: the number of UCX
  // events handled, or -1 when another thread holds it.
  int TryProgress();

  const ucp_worker_h worker_;
  absl::Mutex* const worker_mu_;
  int ucx_efd_ = -1, wake_fd_ = -1, epoll_fd_ = -1;
  std::thread thread_;
  // Lock-free coordination between callers and the background thread.
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<int> driving_{0};              // callers progressing the worker in Drive()
  std::atomic<int64_t> last_drive_end_{0};   // when a caller last stopped driving (steady ns)
  std::atomic<bool> takeover_{false};        // the background thread is needed now
};

}  // namespace pippy::transport::ucx

#endif  // PIPPY_PIPELINE_TRANSPORT_UCX_PROGRESS_H_
