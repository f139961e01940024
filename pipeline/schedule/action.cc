#include "pipeline/schedule/action.h"

#include <cctype>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pippy::schedule {

bool Action::IsCompute() const {
  return type == ActionType::kForward || type == ActionType::kBackward ||
         type == ActionType::kBackwardInput || type == ActionType::kBackwardWeight;
}

const char* ActionTypeName(ActionType type) {
  switch (type) {
    case ActionType::kForward: return "F";
    case ActionType::kBackward: return "B";
    case ActionType::kBackwardInput: return "I";
    case ActionType::kBackwardWeight: return "W";
    case ActionType::kSendForward: return "SEND_F";
    case ActionType::kRecvForward: return "RECV_F";
    case ActionType::kSendBackward: return "SEND_B";
    case ActionType::kRecvBackward: return "RECV_B";
  }
  return "?";
}

std::string Action::ToString() const {
  return absl::StrCat(stage, ActionTypeName(type), microbatch);
}

absl::StatusOr<Action> ParseAction(const std::string& text) {
  auto bad = [&]() {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not an action: expected STAGE TYPE MICROBATCH such as 0F3, 1B2, 2I0, "
        "2W0, 0SEND_F3, 1RECV_F3, 1SEND_B3 or 0RECV_B3"));
  };
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  size_t j = text.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(text[j - 1]))) --j;
  if (i == 0 || j == text.size() || j <= i) return bad();
  Action a;
  if (!absl::SimpleAtoi(text.substr(0, i), &a.stage) || !absl::SimpleAtoi(text.substr(j), &a.microbatch)) {
    return bad();
  }
  const std::string type = text.substr(i, j - i);
  static const std::pair<const char*, ActionType> kTypes[] = {
      {"F", ActionType::kForward},           {"B", ActionType::kBackward},
      {"I", ActionType::kBackwardInput},     {"W", ActionType::kBackwardWeight},
      {"SEND_F", ActionType::kSendForward},  {"RECV_F", ActionType::kRecvForward},
      {"SEND_B", ActionType::kSendBackward}, {"RECV_B", ActionType::kRecvBackward},
  };
  for (const auto& [name, t] : kTypes) {
    if (type == name) {
      a.type = t;
      return a;
    }
  }
  return bad();
}

}  // namespace pippy::schedule
