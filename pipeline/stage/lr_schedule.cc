#include "pipeline/stage/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace pippy::stage {
namespace {

constexpr double kPi = 3.141592653589793;  // math.pi

// Python's a % b for b > 0 (never negative).
int Mod(int a, int b) { return ((a % b) + b) % b; }

// One of torch's recursive decay schedulers over T steps from `base` to `eta_min`:
// `Recursive(e, lr)` is its get_lr() at last_epoch e given the group's current lr,
// `Closed(e)` its _get_closed_form_lr() (what step(e) uses).
struct Decay {
  LrScheduleKind kind;
  double base;
  double eta_min;
  int T;

  double Recursive(int e, double lr) const {
    if (kind == LR_SCHEDULE_COSINE) {
      if (e == 0) return lr;
      if (Mod(e - 1 - T, 2 * T) == 0) return lr + (base - eta_min) * (1 - std::cos(kPi / T)) / 2;
      return (1 + std::cos(kPi * e / T)) / (1 + std::cos(kPi * (e - 1) / T)) * (lr - eta_min) + eta_min;
    }
    // LinearLR(start_factor=1.0, end_factor=eta_min / base, total_iters=T).
    const double start = 1.0, end = eta_min / base;
    if (e == 0) return lr * start;
    if (e > T) return lr;
    return lr * (1. + (end - start) / (T * start + (e - 1) * (end - start)));
  }

  double Closed(int e) const {
    if (kind == LR_SCHEDULE_COSINE) return eta_min + (base - eta_min) * (1 + std::cos(kPi * e / T)) / 2;
    const double start = 1.0, end = eta_min / base;
    return base * (start + (end - start) * std::min(T, e) / T);
  }
};

}  // namespace

std::vector<double> LearningRates(const OptimizerSpec& o, int steps) {
  std::vector<double> lrs;
  if (steps <= 0) return lrs;
  lrs.reserve(steps);
  const double base = o.lr();
  const int W = std::max(0, o.warmup_steps());
  const auto warm = [&](int s) { return base * (static_cast<double>(s + 1) / W); };
  if (o.lr_schedule() != LR_SCHEDULE_LINEAR && o.lr_schedule() != LR_SCHEDULE_COSINE) {
    for (int k = 0; k < steps; ++k) lrs.push_back(W > 0 ? base * std::min(1.0, static_cast<double>(k + 1) / W) : base);
    return lrs;
  }
  const Decay decay{o.lr_schedule(), base, o.min_lr(), std::max(1, steps - W)};
  double lr = W > 0 ? warm(0) : decay.Recursive(0, base);
  lrs.push_back(lr);
  for (int k = 1; k < steps; ++k) {
    if (W == 0) {
      lr = decay.Recursive(k, lr);
    } else if (k < W) {
      lr = warm(k);
    } else if (k == W) {
      lr = decay.Closed(0);
    } else {
      lr = decay.Recursive(k - W, lr);
    }
    lrs.push_back(lr);
  }
  return lrs;
}

}  // namespace pippy::stage
