// Learning-rate schedules (the job spec's OptimizerSpec.lr_schedule), computed as
// torch.optim.lr_scheduler computes them: the same floating-point operations in the
// same order, so that a pipeline trained with a schedule equals a PyTorch loop that
// steps the scheduler after each optimizer step, bit for bit. With base lr η, warm-up
// W, T = steps − W and min_lr η_min, step k's learning rate is what these give after k
// scheduler steps:
//   constant, W = 0: η (no scheduler)
//   constant, W > 0: LambdaLR(opt, lambda s: min(1.0, (s + 1) / W))
//   cosine:          CosineAnnealingLR(opt, T_max=T, eta_min=η_min)
//   linear:          LinearLR(opt, start_factor=1.0, end_factor=η_min / η, total_iters=T)
// and, for cosine and linear with W > 0, SequentialLR(opt, [LambdaLR(opt, lambda s:
// (s + 1) / W), that scheduler], milestones=[W]). torch's schedulers are recursive
// (each step scales the previous learning rate), and SequentialLR restarts the second
// one with step(0), its closed form; both are followed here, not a closed form that
// would differ from torch's in the last bits.
#ifndef PIPPY_PIPELINE_STAGE_LR_SCHEDULE_H_
#define PIPPY_PIPELINE_STAGE_LR_SCHEDULE_H_

#include <vector>

#include "proto/job.pb.h"

namespace pippy::stage {

// The learning rate of each step 0 .. steps − 1 (step k's optimizer step uses [k]),
// for an OptimizerSpec that job::CheckSpec accepted (warm-up < steps for cosine and
// linear, 0 <= min_lr <= lr).
std::vector<double> LearningRates(const OptimizerSpec& optimizer, int steps);

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_LR_SCHEDULE_H_
