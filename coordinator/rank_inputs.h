// A micro-batch's model inputs as each rank gets them (serving.cc, generation.cc):
// LibTorch's types, so only their .cc files include it.
#ifndef PIPPY_COORDINATOR_RANK_INPUTS_H_
#define PIPPY_COORDINATOR_RANK_INPUTS_H_

#include <string>
#include <vector>

#include "ATen/core/Tensor.h"

namespace pippy::coordinator {

// Each rank's inputs: a pickled tuple of forward()'s arguments (`batch`, by argument),
// None where it reads none ("" for a rank that reads no input at all: `needs[r]` empty).
std::vector<std::string> PickleRankInputs(const std::vector<at::Tensor>& batch,
                                          const std::vector<std::vector<int>>& needs);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_RANK_INPUTS_H_
