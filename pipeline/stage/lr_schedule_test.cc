// The schedules against the learning rates torch 1.13's schedulers gave for the same
// settings (printed by /usr/bin/python3 with repr, i.e. every bit): pippy's must be
// equal, not close, for a pipeline trained with them to equal a PyTorch loop bitwise.
// How they were made (`s` stepped after each optimizer step; lr read before it):
//   d = CosineAnnealingLR(opt, T_max=steps - W, eta_min=min_lr)          # cosine
//   d = LinearLR(opt, start_factor=1.0, end_factor=min_lr / lr, total_iters=steps - W)
//   s = SequentialLR(opt, [LambdaLR(opt, lambda k: (k + 1) / W), d], milestones=[W]) if W else d
//   s = LambdaLR(opt, lambda k: min(1.0, (k + 1) / W))                   # constant, W > 0
#include "pipeline/stage/lr_schedule.h"

#include <vector>

#include "gtest/gtest.h"

namespace pippy::stage {
namespace {

OptimizerSpec Spec(LrScheduleKind kind, double lr, int warmup, double min_lr) {
  OptimizerSpec o;
  o.set_lr(lr);
  o.set_lr_schedule(kind);
  o.set_warmup_steps(warmup);
  o.set_min_lr(min_lr);
  return o;
}

void ExpectBitwise(const std::vector<double>& got, const std::vector<double>& torch) {
  ASSERT_EQ(got.size(), torch.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k], torch[k]) << "step " << k << ": " << got[k] << " vs torch's " << torch[k];
  }
}

TEST(LrSchedule, CosineWithWarmup_EqualsTorchSequentialLR) {
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_COSINE, 0.003, 5, 3e-4), 30),
                {0.0006000000000000001, 0.0012000000000000001, 0.0018, 0.0024000000000000002, 0.003, 0.003,
                 0.0029893548467745455, 0.0029575872675236523, 0.00290519825594914, 0.002833014018059216,
                 0.0027421729424061793, 0.0026341076470189056, 0.002510522386160731, 0.002373366173221645,
                 0.002224802043612848, 0.002067172942406179, 0.0019029647746907287, 0.0017347672013645734,
                 0.0015652327986354273, 0.0013970352253092721, 0.0012328270575938218, 0.0010751979563871522,
                 0.0009266338267783544, 0.0007894776138392689, 0.0006658923529810948, 0.0005578270575938212,
                 0.0004669859819407843, 0.0003948017440508607, 0.0003424127324763482, 0.000310645153225455});
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_COSINE, 1e-3, 2, 1e-5), 3), {0.0005, 0.001, 0.001});
}

TEST(LrSchedule, LinearWithWarmup_EqualsTorchSequentialLR) {
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_LINEAR, 0.003, 5, 3e-4), 30),
                {0.0006000000000000001, 0.0012000000000000001, 0.0018, 0.0024000000000000002, 0.003, 0.003, 0.002892,
                 0.002784, 0.002676, 0.002568, 0.00246, 0.002352, 0.002244, 0.002136, 0.002028, 0.0019199999999999998,
                 0.0018119999999999998, 0.0017039999999999998, 0.0015959999999999998, 0.0014879999999999997,
                 0.0013799999999999997, 0.0012719999999999997, 0.0011639999999999997, 0.0010559999999999996,
                 0.0009479999999999996, 0.0008399999999999996, 0.0007319999999999997, 0.0006239999999999997,
                 0.0005159999999999996, 0.0004079999999999998});
}

TEST(LrSchedule, WithoutWarmup_EqualsTorchsSchedulerAlone) {
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_COSINE, 0.1, 0, 0.0), 7),
                {0.1, 0.09504844339512096, 0.08117449009293669, 0.061126046697815725, 0.03887395330218429,
                 0.018825509907063328, 0.004951556604879048});
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_LINEAR, 0.1, 0, 0.01), 7),
                {0.1, 0.08714285714285715, 0.07428571428571429, 0.06142857142857143, 0.04857142857142857,
                 0.03571428571428572, 0.02285714285714286});
}

TEST(LrSchedule, Constant_WithAndWithoutWarmup) {
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_CONSTANT, 0.003, 3, 0.0), 10),
                {0.001, 0.002, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003});
  ExpectBitwise(LearningRates(Spec(LR_SCHEDULE_UNSPECIFIED, 0.25, 0, 0.0), 3), {0.25, 0.25, 0.25});
  EXPECT_TRUE(LearningRates(Spec(LR_SCHEDULE_COSINE, 0.1, 0, 0.0), 0).empty());
}

}  // namespace
}  // namespace pippy::stage
