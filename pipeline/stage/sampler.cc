#include "pipeline/stage/sampler.h"

#include <algorithm>

namespace pippy::stage {
namespace {

uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int BitLength(uint64_t v) {
  int bits = 0;
  for (; v != 0; v >>= 1) ++bits;
  return bits;
}

}  // namespace

Sampler::Sampler(int64_t samples, int64_t batch, bool shuffle, uint64_t seed)
    : samples_(samples), batch_(batch), shuffle_(shuffle), seed_(seed) {
  half_bits_ = std::max(1, (BitLength(static_cast<uint64_t>(samples - 1)) + 1) / 2);
}

Sampler::Position Sampler::PositionOf(int64_t step) const {
  const int64_t per_epoch = steps_per_epoch();
  return Position{step / per_epoch, (step % per_epoch) * batch_};
}

int64_t Sampler::SampleAt(int64_t epoch, int64_t index) const {
  if (!shuffle_) return index;
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  const uint64_t key = Mix(seed_ ^ Mix(static_cast<uint64_t>(epoch)));
  uint64_t x = static_cast<uint64_t>(index);
  // Cycle walking: the network permutes [0, 4^h), at most 4 x samples, so a walk
  // leaves it in under 4 rounds on average, and stays a permutation of [0, samples).
  do {
    uint64_t l = x >> half_bits_, r = x & mask;
    for (uint64_t k = 0; k < 4; ++k) {
      const uint64_t next = l ^ (Mix((key + k) ^ r) & mask);
      l = r;
      r = next;
    }
    x = (l << half_bits_) | r;
  } while (x >= static_cast<uint64_t>(samples_));
  return static_cast<int64_t>(x);
}

std::vector<int64_t> Sampler::Indices(int64_t step, int replica, int replicas) const {
  const Position at = PositionOf(step);
  const int64_t slice = batch_ / replicas;
  const int64_t begin = at.index + replica * slice;
  std::vector<int64_t> out(static_cast<size_t>(slice));
  for (int64_t i = 0; i < slice; ++i) out[static_cast<size_t>(i)] = SampleAt(at.epoch, begin + i);
  return out;
}

}  // namespace pippy::stage
