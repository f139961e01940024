#include "pipeline/stage/sampler.h"

#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace pippy::stage {
namespace {

TEST(SamplerTest, InOrder_StepsTakeConsecutiveBatchesAndDropTheEpochsRest) {
  Sampler s(/*samples=*/10, /*batch=*/4, /*shuffle=*/false, /*seed=*/0);
  EXPECT_EQ(s.steps_per_epoch(), 2);
  EXPECT_EQ(s.Indices(0), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(s.Indices(1), (std::vector<int64_t>{4, 5, 6, 7}));
  // Samples 8 and 9 are dropped: step 2 starts epoch 1 again at 0.
  EXPECT_EQ(s.Indices(2), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(s.PositionOf(3).epoch, 1);
  EXPECT_EQ(s.PositionOf(3).index, 4);
  EXPECT_EQ(s.Indices(1, 1, 2), (std::vector<int64_t>{6, 7}));
}

// The permutation docs/data.md writes out, computed there in Python by its formula
// (an independent implementation): these are its first values.
TEST(SamplerTest, Shuffle_MatchesTheDocumentedPermutation) {
  Sampler a(10, 10, true, /*seed=*/0);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t i = 0; i < 10; ++i) {
    epoch0.push_back(a.SampleAt(0, i));
    epoch1.push_back(a.SampleAt(1, i));
  }
  EXPECT_EQ(epoch0, (std::vector<int64_t>{7, 2, 9, 4, 3, 6, 1, 8, 0, 5}));
  EXPECT_EQ(epoch1, (std::vector<int64_t>{3, 2, 1, 6, 5, 4, 7, 0, 8, 9}));
  Sampler b(1000, 8, true, /*seed=*/7);
  EXPECT_EQ(b.Indices(/*step=*/3 * b.steps_per_epoch()), (std::vector<int64_t>{533, 596, 146, 126, 12, 980, 724, 915}));
}

TEST(SamplerTest, Shuffle_EveryEpochIsAPermutation) {
  for (int64_t n : {1, 2, 3, 7, 64, 1000, 1023, 1024, 1025, 99991}) {
    Sampler s(n, 1, true, /*seed=*/42);
    for (int64_t epoch : {0, 1, 5}) {
      std::vector<int> seen(static_cast<size_t>(n), 0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t x = s.SampleAt(epoch, i);
        ASSERT_GE(x, 0);
        ASSERT_LT(x, n);
        ++seen[static_cast<size_t>(x)];
      }
      for (int64_t x = 0; x < n; ++x) ASSERT_EQ(seen[static_cast<size_t>(x)], 1) << "n=" << n << " sample " << x;
    }
  }
}

TEST(SamplerTest, Shuffle_DependsOnTheSeedAndTheEpochOnly) {
  Sampler a(1000, 10, true, 1), again(1000, 10, true, 1), other(1000, 10, true, 2);
  EXPECT_EQ(a.Indices(0), again.Indices(0));
  EXPECT_NE(a.Indices(0), other.Indices(0));
  EXPECT_NE(a.Indices(0), a.Indices(a.steps_per_epoch()));  // the next epoch's first batch
  EXPECT_EQ(a.Indices(5), again.Indices(5));                 // a resumed job at step 5 reads what step 5 read
}

// Data parallelism: the replicas of an epoch read each sample exactly once between them.
TEST(SamplerTest, Replicas_ReadEverySampleOfAnEpochOnce) {
  const int64_t samples = 96, batch = 8;
  for (bool shuffle : {false, true}) {
    Sampler s(samples, batch, shuffle, /*seed=*/3);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      std::map<int64_t, int> reads;
      for (int64_t step = epoch * s.steps_per_epoch(); step < (epoch + 1) * s.steps_per_epoch(); ++step) {
        for (int r = 0; r < 2; ++r) {
          const std::vector<int64_t> mine = s.Indices(step, r, 2);
          ASSERT_EQ(mine.size(), 4u);
          for (int64_t x : mine) ++reads[x];
        }
      }
      ASSERT_EQ(reads.size(), static_cast<size_t>(samples)) << "shuffle " << shuffle << " epoch " << epoch;
      for (const auto& [x, n] : reads) EXPECT_EQ(n, 1) << "sample " << x;
    }
  }
}

}  // namespace
}  // namespace pippy::stage
