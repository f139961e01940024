// Whether a daemon's own loop still turns: the loop beats each pass; health checks and
// the systemd watchdog ask whether the last beat is recent. A coordinator whose loop is
// stuck (its mutex held by a thread that never lets go) then says NOT_SERVING and stops
// pinging the watchdog, so systemd or Kubernetes restart it, instead of answering
// SERVING while every call waits.
//
// Thread safety: Beat and Alive may be called from any thread.
#ifndef PIPPY_COMMON_LIVENESS_H_
#define PIPPY_COMMON_LIVENESS_H_

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pippy {

class Liveness {
 public:
  Liveness() { Beat(); }
  void Beat() { last_ms_ = absl::ToUnixMillis(absl::Now()); }
  // The last beat was within `limit` of now.
  bool Alive(absl::Duration limit) const { return absl::Now() - absl::FromUnixMillis(last_ms_) <= limit; }
  absl::Duration SinceBeat() const { return absl::Now() - absl::FromUnixMillis(last_ms_); }

 private:
  std::atomic<int64_t> last_ms_{0};
};

}  // namespace pippy

#endif  // PIPPY_COMMON_LIVENESS_H_
