// Which samples of a dataset each step reads (docs/data.md).
//
// An epoch is every sample once, in order or, with shuffle, in the order of a seeded
// permutation of [0, samples) that is computed index by index (a 4-round Feistel
// network with cycle walking, written out below and in docs/data.md), so that no
// rank holds a table as large as the dataset. Epoch e is cut into batches of `batch`
// samples; the samples after its last whole batch are dropped, as
// DataLoader(drop_last=True) drops them, so that every step's batch is whole. Step k
// reads batch k % steps_per_epoch of epoch k / steps_per_epoch, and with R replicas
// (data parallelism) replica r takes the r-th of R contiguous equal slices of it: the
// replicas of an epoch read each of its samples at most once between them (exactly
// once when batch divides samples).
//
// The order is a function of the step alone, so a job resumed at step k (from a
// checkpoint, or with --resume-from) reads exactly the rows the uninterrupted job would.
//
// The permutation of epoch e with seed s, for n samples: h = max(1, ceil(b / 2)) where
// b is the bit length of n - 1, m = 2^h - 1, key = mix(s ^ mix(e)), and
//   P(i): x = i; repeat { l = x >> h; r = x & m;
//                         for k in 0..3: (l, r) = (r, l ^ (mix((key + k) ^ r) & m));
//                         x = (l << h) | r } until x < n; return x
// with mix splitmix64's finaliser (z += 0x9E3779B97F4A7C15; z = (z ^ z >> 30) *
// 0xBF58476D1CE4E5B9; z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^ z >> 31), all in
// unsigned 64-bit arithmetic.
//
// Thread safety: immutable; any thread.
#ifndef PIPPY_PIPELINE_STAGE_SAMPLER_H_
#define PIPPY_PIPELINE_STAGE_SAMPLER_H_

#include <cstdint>
#include <vector>

namespace pippy::stage {

class Sampler {
 public:
  // REQUIRES: 0 < batch <= samples.
  Sampler(int64_t samples, int64_t batch, bool shuffle, uint64_t seed);

  int64_t samples() const { return samples_; }
  int64_t steps_per_epoch() const { return samples_ / batch_; }

  // Where step `step` reads: its epoch and the index, within the epoch's order, of the
  // first sample of its batch.
  struct Position {
    int64_t epoch = 0;
    int64_t index = 0;
  };
  Position PositionOf(int64_t step) const;

  // The samples (in [0, samples)) of replica `replica` of `replicas`' slice of step
  // `step`'s batch, in order. REQUIRES: batch % replicas == 0.
  std::vector<int64_t> Indices(int64_t step, int replica = 0, int replicas = 1) const;

  // Position `index` of epoch `epoch`'s order: the permutation above (shuffle), else
  // `index` itself.
  int64_t SampleAt(int64_t epoch, int64_t index) const;

 private:
  const int64_t samples_;
  const int64_t batch_;
  const bool shuffle_;
  const uint64_t seed_;
  int half_bits_ = 1;  // h above
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_SAMPLER_H_
