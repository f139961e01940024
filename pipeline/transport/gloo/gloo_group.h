// A ReplicaGroup over gloo's TCP transport (Debian's libgloo).
//
// Rendezvous goes through whoever places the ranks (the coordinator): each member
// opens one TCP endpoint per other member (Create), hands address() to the placer,
// and Connect()s with every member's address once all are known. No store, no extra
// service.
#ifndef PIPPY_PIPELINE_TRANSPORT_GLOO_GLOO_GROUP_H_
#define PIPPY_PIPELINE_TRANSPORT_GLOO_GLOO_GROUP_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipeline/transport/replica_group.h"

namespace pippy::transport::gloo_group {

class GlooGroup : public ReplicaGroup {
 public:
  // Member `index` of `size`, listening on `hostname` (an address the other members
  // can reach: 127.0.0.1 on one machine, the host's name or IP across hosts).
  // `timeout` bounds connecting and every collective.
  // Errors: INVALID_ARGUMENT for a bad index or size; UNAVAILABLE when the endpoints
  // cannot be opened.
  static absl::StatusOr<std::unique_ptr<GlooGroup>> Create(int index, int size, const std::string& hostname,
                                                           absl::Duration timeout);
  ~GlooGroup() override;

  // What the other members need to reach this one (opaque bytes).
  const std::string& address() const { return address_; }
  // Connects to every other member; addresses[i] is member i's address().
  // Errors: INVALID_ARGUMENT for malformed addresses; UNAVAILABLE or
  // DEADLINE_EXCEEDED when a member cannot be reached in time.
  absl::Status Connect(const std::vector<std::string>& addresses);

  int size() const override { return size_; }
  int index() const override { return index_; }
  absl::Status AllReduceSum(at::Tensor& flat) override;

 private:
  struct State;
  GlooGroup() = default;
  int index_ = 0, size_ = 1;
  absl::Duration timeout_;
  std::string address_;
  std::unique_ptr<State> state_;
  uint32_t tag_ = 0;
  bool connected_ = false;
};

}  // namespace pippy::transport::gloo_group

#endif  // PIPPY_PIPELINE_TRANSPORT_GLOO_GLOO_GROUP_H_
