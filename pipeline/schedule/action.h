// Pipeline actions in torch.distributed.pipelining's notation.
//
//   0F3        stage 0, forward, micro-batch 3
//   1B2        full backward (inputs and weights)
//   1I2 / 1W2  backward for inputs only / for weights only (zero-bubble schedules)
//   0SEND_F3   send stage 0's forward outputs of micro-batch 3 to its consumers
//   1RECV_F3   receive stage 1's forward inputs of micro-batch 3 from its producers
//   1SEND_B3 / 0RECV_B3   the same for gradients, backwards
//
// A SEND/RECV names the stage whose data it carries; it covers every peer of that
// stage on another rank (a stage with a skip connection receives from several).
#ifndef PIPPY_PIPELINE_SCHEDULE_ACTION_H_
#define PIPPY_PIPELINE_SCHEDULE_ACTION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pippy::schedule {

enum class ActionType {
  kForward,         // F
  kBackward,        // B: full backward
  kBackwardInput,   // I
  kBackwardWeight,  // W
  kSendForward,     // SEND_F
  kRecvForward,     // RECV_F
  kSendBackward,    // SEND_B
  kRecvBackward,    // RECV_B
};

struct Action {
  int stage = 0;
  ActionType type = ActionType::kForward;
  int microbatch = 0;

  bool IsCompute() const;
  bool IsComm() const { return !IsCompute(); }
  bool IsSend() const { return IsSend(type); }
  bool IsRecv() const { return IsRecv(type); }
  static bool IsSend(ActionType t) { return t == ActionType::kSendForward || t == ActionType::kSendBackward; }
  static bool IsRecv(ActionType t) { return t == ActionType::kRecvForward || t == ActionType::kRecvBackward; }
  std::string ToString() const;  // "0F3"
  bool operator==(const Action& o) const {
    return stage == o.stage && type == o.type && microbatch == o.microbatch;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

// Parses "0F3", "1SEND_B2", ... Errors: INVALID_ARGUMENT naming the text.
absl::StatusOr<Action> ParseAction(const std::string& text);

// "F", "B", "I", "W", "SEND_F", ...
const char* ActionTypeName(ActionType type);

using ActionList = std::vector<Action>;

}  // namespace pippy::schedule

#endif  // PIPPY_PIPELINE_SCHEDULE_ACTION_H_
