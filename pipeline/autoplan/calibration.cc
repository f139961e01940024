#include "pipeline/autoplan/calibration.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipeline/schedule/action.h"

namespace pippy::autoplan {
namespace {

enum Kind { kF = 0, kB = 1, kI = 2, kW = 3 };

double At(const google::protobuf::RepeatedField<double>& v, int i) { return i >= 0 && i < v.size() ? v[i] : 0; }

}  // namespace

void CalibrationSample::Add(const std::vector<TimedCompute>& actions) {
  for (const TimedCompute& a : actions) {
    absl::StatusOr<schedule::Action> action = schedule::ParseAction(a.name);
    if (!action.ok() || !action->IsCompute()) continue;
    const int stage = action->stage;
    const double f = At(chosen_.stage_forward_us(), stage), in = At(chosen_.stage_input_us(), stage),
                 w = At(chosen_.stage_weight_us(), stage);
    int kind;
    double predicted;
    switch (action->type) {
      case schedule::ActionType::kForward: kind = kF; predicted = f; break;
      case schedule::ActionType::kBackward: kind = kB; predicted = in + w; break;
      case schedule::ActionType::kBackwardInput: kind = kI; predicted = in; break;
      case schedule::ActionType::kBackwardWeight: kind = kW; predicted = w; break;
      default: continue;
    }
    // A stage with nothing predicted for the kind (the first stage's I) teaches nothing.
    if (predicted <= 0) continue;
    measured_[kind] += a.micros;
    predicted_[kind] += predicted;
  }
}

std::optional<ActionFactors> CalibrationSample::Factors(int ranks_on_host) const {
  ActionFactors f;
  f.set_ranks_on_host(std::max(1, ranks_on_host));
  f.set_jobs(1);
  bool any = false;
  auto ratio = [&](int k) {
    if (predicted_[k] <= 0 || measured_[k] <= 0) return 0.0;
    any = true;
    return measured_[k] / predicted_[k];
  };
  f.set_forward(ratio(kF));
  f.set_backward(ratio(kB));
  f.set_backward_input(ratio(kI));
  f.set_backward_weight(ratio(kW));
  if (!any) return std::nullopt;
  return f;
}

void Merge(const ActionFactors& learned, std::vector<ActionFactors>* table) {
  auto it = std::find_if(table->begin(), table->end(),
                         [&](const ActionFactors& t) { return t.ranks_on_host() == learned.ranks_on_host(); });
  if (it == table->end()) {
    table->push_back(learned);
    std::sort(table->begin(), table->end(),
              [](const ActionFactors& x, const ActionFactors& y) { return x.ranks_on_host() < y.ranks_on_host(); });
    return;
  }
  const double n = std::min(4, it->jobs());
  auto fold = [n](double old, double now) {
    if (now <= 0) return old;
    if (old <= 0) return now;
    return (old * n + now) / (n + 1);
  };
  it->set_forward(fold(it->forward(), learned.forward()));
  it->set_backward(fold(it->backward(), learned.backward()));
  it->set_backward_input(fold(it->backward_input(), learned.backward_input()));
  it->set_backward_weight(fold(it->backward_weight(), learned.backward_weight()));
  it->set_jobs(it->jobs() + 1);
}

const ActionFactors* FactorsFor(const google::protobuf::RepeatedPtrField<ActionFactors>& table, int together) {
  const ActionFactors* best = nullptr;
  for (const ActionFactors& f : table) {
    if (f.ranks_on_host() <= together && (best == nullptr || f.ranks_on_host() > best->ranks_on_host())) best = &f;
  }
  return best;
}

std::string DescribeFactors(const ActionFactors& f) {
  std::vector<std::string> parts;
  for (const auto& [name, v] : {std::pair<const char*, double>{"F", f.forward()}, {"B", f.backward()},
                                {"I", f.backward_input()}, {"W", f.backward_weight()}}) {
    if (v > 0) parts.push_back(absl::StrFormat("%s x%.2f", name, v));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace pippy::autoplan
