// A generation job's sampling on the last stage's rank: one token per row from the
// logits of the row's last position, greedy or with temperature / top-k / top-p. A
// draw is seeded by (SampleRow.seed, SampleRow.token_index) alone, so a sequence's
// tokens do not depend on which other sequences share its micro-batches, on the
// worker, or on the run.
//
// Thread safety: a free function; no state.
#ifndef PIPPY_WORKER_TOKEN_SAMPLER_H_
#define PIPPY_WORKER_TOKEN_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/coordinator.pb.h"

namespace at {
class Tensor;
}

namespace pippy::worker {

// `logits`: the model's output, Float[B, L, vocab] (or [B, vocab]); `rows`: B entries.
// Returns B token ids, -1 where rows[b].sample is false. Errors: INVALID_ARGUMENT when
// the output is not such a tensor (naming its shape).
absl::StatusOr<std::vector<int64_t>> SampleTokens(const at::Tensor& logits,
                                                  const google::protobuf::RepeatedPtrField<SampleRow>& rows);

// The seed of one draw: a mix of the sequence's seed and the token's index.
uint64_t DrawSeed(uint64_t seed, int64_t token_index);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_TOKEN_SAMPLER_H_
