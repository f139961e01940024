#include "pipeline/stage/dataset.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "ATen/ATen.h"
#include "gtest/gtest.h"

namespace pippy::stage {
namespace {
namespace fs = std::filesystem;

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("pippy_dataset_test_" + std::to_string(getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "tokens");
  }
  void TearDown() override { fs::remove_all(root_); }

  // Token ids first, first + 1, ... (mod `modulo`) as uint16, in shards of these sizes.
  void WriteTokens(const std::vector<int64_t>& shard_tokens, int64_t modulo = 65536) {
    int64_t next = 0;
    for (size_t s = 0; s < shard_tokens.size(); ++s) {
      std::ofstream f(root_ / "tokens" / ("shard_" + std::to_string(s) + ".bin"), std::ios::binary);
      for (int64_t t = 0; t < shard_tokens[s]; ++t, ++next) {
        const uint16_t id = static_cast<uint16_t>(next % modulo);
        f.write(reinterpret_cast<const char*>(&id), 2);
      }
    }
  }

  // The shards of pipeline/stage/testing/make_tensor_shards.py's folder `kind`,
  // written by Python's torch.save, copied under the test's root.
  fs::path CopyShards(const std::string& kind) {
    const fs::path to = root_ / "shards";
    fs::create_directories(to);
    for (const auto& e : fs::directory_iterator(fs::path("pipeline/stage/testing/shards") / kind)) {
      fs::copy_file(e.path(), to / e.path().filename());
    }
    return to;
  }

  DatasetSpec Tokens(int seq_len, bool shuffle = false) const {
    DatasetSpec spec;
    spec.set_path((root_ / "tokens").string());
    spec.set_seq_len(seq_len);
    spec.set_shuffle(shuffle);
    return spec;
  }
  std::vector<std::string> Roots() const { return {root_.string()}; }

  fs::path root_;
  const std::vector<std::string> one_arg_ = {"idx"};
};

TEST_F(DatasetTest, Tokens_WindowsOverlapByOneTokenAcrossShards) {
  WriteTokens({10, 7, 20});  // 37 tokens; windows of 5 start every 4 tokens
  absl::StatusOr<DatasetLayout> index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_TRUE(index->tokens());
  EXPECT_EQ(index->samples(), 9);  // (37 - 1) / 4
  EXPECT_EQ(index->steps_per_epoch(), 4);
  auto ds = Dataset::Open(Tokens(4), *index, one_arg_, {0}, true, 2, 0, Roots());
  ASSERT_TRUE(ds.ok()) << ds.status();
  for (int64_t step = 0; step < 4; ++step) {
    absl::StatusOr<Batch> b = (*ds)->Read(step, 2, 0, 1);
    ASSERT_TRUE(b.ok()) << b.status();
    const at::Tensor x = b->inputs[0].toTensor(), y = b->target.toTensor();
    ASSERT_EQ(x.sizes(), (std::vector<int64_t>{2, 4}));
    EXPECT_EQ(x.scalar_type(), at::kLong);
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t sample = step * 2 + j;
      for (int64_t t = 0; t < 4; ++t) {
        EXPECT_EQ(x[j][t].item<int64_t>(), sample * 4 + t);      // its first L tokens
        EXPECT_EQ(y[j][t].item<int64_t>(), sample * 4 + t + 1);  // its last L
      }
    }
  }
  // Sample 2 spans shards 0 and 1 (tokens 8..12), sample 4 shards 1 and 2 (16..20).
  EXPECT_GT((*ds)->bytes_read(), 0);
}

TEST_F(DatasetTest, Tokens_ARankReadsOnlyWhatItNeeds) {
  WriteTokens({100});
  auto index = IndexDataset(Tokens(4), one_arg_, 4, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  auto first = Dataset::Open(Tokens(4), *index, one_arg_, {0}, false, 4, 0, Roots());
  auto last = Dataset::Open(Tokens(4), *index, one_arg_, {}, true, 4, 0, Roots());
  ASSERT_TRUE(first.ok() && last.ok());
  absl::StatusOr<Batch> a = (*first)->Read(0, 4, 0, 1), b = (*last)->Read(0, 4, 0, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->inputs[0].isTensor());
  EXPECT_TRUE(a->target.isNone());
  EXPECT_TRUE(b->inputs[0].isNone());
  EXPECT_TRUE(b->target.isTensor());
}

// Batches' buffers are recycled (dataset.cc's BufferPool): one still held is never
// written by a later read, and a batch outlives its reader.
TEST_F(DatasetTest, Tokens_HeldBatchesKeepTheirValuesAcrossLaterReads) {
  WriteTokens({2000});
  for (bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "shuffled" : "in order");
    auto index = IndexDataset(Tokens(8, shuffle), one_arg_, 4, Roots());
    ASSERT_TRUE(index.ok()) << index.status();
    auto ds = Dataset::Open(Tokens(8, shuffle), *index, one_arg_, {0}, true, 4, 0, Roots());
    ASSERT_TRUE(ds.ok()) << ds.status();
    std::vector<at::Tensor> held, copies;
    for (int64_t step = 0; step < 30; ++step) {  // more batches than the pool keeps
      absl::StatusOr<Batch> b = (*ds)->Read(step, 4, 0, 1);
      ASSERT_TRUE(b.ok()) << b.status();
      const at::Tensor x = b->inputs[0].toTensor(), y = b->target.toTensor();
      // Each row is a window: ids sample * 8 + t, the targets one further.
      const std::vector<int64_t> samples = (*ds)->sampler().Indices(step);
      for (int64_t j = 0; j < 4; ++j) {
        ASSERT_EQ(x[j][0].item<int64_t>(), samples[static_cast<size_t>(j)] * 8);
        ASSERT_EQ(y[j][7].item<int64_t>(), samples[static_cast<size_t>(j)] * 8 + 8);
      }
      if (step % 2 == 0) {  // every other batch held, the rest dropped (and recycled)
        held.push_back(x);
        copies.push_back(x.clone());
        held.push_back(y);
        copies.push_back(y.clone());
      }
    }
    ds->reset();  // the held tensors outlive the reader
    for (size_t i = 0; i < held.size(); ++i) {
      EXPECT_TRUE(at::equal(held[i], copies[i])) << "batch tensor " << i << " changed after later reads";
    }
  }
}

// Data parallelism with shuffle, counted through the reader: every sample of an epoch
// is read exactly once across the two replicas (a window's first token tells its sample).
TEST_F(DatasetTest, Tokens_ShuffledReplicasReadEachSampleOnceAnEpoch) {
  const int64_t L = 4, samples = 96;
  WriteTokens({150, samples * L + 1 - 150});
  auto index = IndexDataset(Tokens(L, true), one_arg_, 8, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->samples(), samples);
  std::vector<std::unique_ptr<Dataset>> replicas;
  for (int r = 0; r < 2; ++r) {
    auto ds = Dataset::Open(Tokens(L, true), *index, one_arg_, {0}, true, 8, /*seed=*/11, Roots());
    ASSERT_TRUE(ds.ok()) << ds.status();
    replicas.push_back(std::move(*ds));
  }
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::map<int64_t, int> reads;
    std::vector<int64_t> order;
    for (int64_t step = epoch * 12; step < (epoch + 1) * 12; ++step) {
      for (int r = 0; r < 2; ++r) {
        absl::StatusOr<Batch> b = replicas[static_cast<size_t>(r)]->Read(step, 8, r, 2);
        ASSERT_TRUE(b.ok()) << b.status();
        const at::Tensor x = b->inputs[0].toTensor();
        ASSERT_EQ(x.size(0), 4);
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t sample = x[j][0].item<int64_t>() / L;
          ++reads[sample];
          order.push_back(sample);
        }
      }
    }
    ASSERT_EQ(reads.size(), static_cast<size_t>(samples));
    for (const auto& [sample, n] : reads) EXPECT_EQ(n, 1) << "epoch " << epoch << " sample " << sample;
    std::vector<int64_t> in_order(order.size());
    for (size_t i = 0; i < in_order.size(); ++i) in_order[i] = static_cast<int64_t>(i);
    EXPECT_NE(order, in_order) << "shuffle on read the samples in order";
  }
}

TEST_F(DatasetTest, Tokens_AnIdOutsideTheEmbeddingFailsTheReadNamingShardAndOffset) {
  WriteTokens({40}, /*modulo=*/30);  // ids 0..29
  auto index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_TRUE(index.ok());
  index->set_token_limit(25);
  auto ds = Dataset::Open(Tokens(4), *index, one_arg_, {0}, true, 2, 0, Roots());
  ASSERT_TRUE(ds.ok());
  EXPECT_TRUE((*ds)->Read(0, 2, 0, 1).ok());  // tokens 0..8
  absl::StatusOr<Batch> b;
  for (int64_t step = 1; step < 4 && (b = (*ds)->Read(step, 2, 0, 1)).ok(); ++step) {
  }
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("shard_0.bin' holds token id 25 at token 25 (byte 50)"), std::string::npos)
      << b.status();
  EXPECT_NE(b.status().message().find("embedding of 25 rows"), std::string::npos) << b.status();
}

TEST_F(DatasetTest, Tokens_BadFoldersAreRefusedNamingTheFile) {
  // Empty.
  absl::StatusOr<DatasetLayout> index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("holds no shards"), std::string::npos) << index.status();
  // A shard of an odd length.
  WriteTokens({20});
  { std::ofstream(root_ / "tokens" / "shard_1.bin", std::ios::binary) << "abc"; }
  index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("shard_1.bin' is 3 bytes, not a multiple of the 2-byte token width"),
            std::string::npos)
      << index.status();
  // Mixed kinds.
  fs::remove(root_ / "tokens" / "shard_1.bin");
  { std::ofstream(root_ / "tokens" / "x.pt") << "x"; }
  index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("mixes token streams"), std::string::npos) << index.status();
  fs::remove(root_ / "tokens" / "x.pt");
  // Too few samples, a model of two arguments, no seq_len.
  index = IndexDataset(Tokens(4), one_arg_, 16, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("fewer than one batch of 16"), std::string::npos) << index.status();
  index = IndexDataset(Tokens(4), {"a", "b"}, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("forward()'s one argument"), std::string::npos) << index.status();
  index = IndexDataset(Tokens(0), one_arg_, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("--seq-len"), std::string::npos) << index.status();
}

TEST_F(DatasetTest, Roots_APathOutsideThemIsRefused) {
  WriteTokens({20});
  absl::StatusOr<DatasetLayout> index = IndexDataset(Tokens(4), one_arg_, 2, {});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(index.status().message().find("none: datasets are off"), std::string::npos) << index.status();
  index = IndexDataset(Tokens(4), one_arg_, 2, {(root_ / "elsewhere").string(), "/nonexistent"});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), absl::StatusCode::kPermissionDenied);
  // A manifest inside the root that names a file outside it, through a link.
  fs::create_directories(root_ / "allowed");
  fs::create_symlink(root_ / "tokens" / "shard_0.bin", root_ / "allowed" / "link.bin");
  { std::ofstream(root_ / "allowed" / "list.txt") << "# shards\nlink.bin\n"; }
  DatasetSpec spec = Tokens(4);
  spec.set_path((root_ / "allowed" / "list.txt").string());
  index = IndexDataset(spec, one_arg_, 2, {(root_ / "allowed").string()});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), absl::StatusCode::kPermissionDenied) << index.status();
  // The same manifest under a root that holds the target reads.
  index = IndexDataset(spec, one_arg_, 2, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->shards(0).path(), fs::canonical(root_ / "tokens" / "shard_0.bin").string());
  // A relative path.
  spec.set_path("tokens");
  EXPECT_FALSE(IndexDataset(spec, one_arg_, 2, Roots()).ok());
}

TEST_F(DatasetTest, Tokens_AShardChangedSinceIndexingIsRefusedWhenOpened) {
  WriteTokens({20, 20});
  auto index = IndexDataset(Tokens(4), one_arg_, 2, Roots());
  ASSERT_TRUE(index.ok());
  { std::ofstream(root_ / "tokens" / "shard_1.bin", std::ios::binary | std::ios::app) << "xy"; }
  auto ds = Dataset::Open(Tokens(4), *index, one_arg_, {0}, true, 2, 0, Roots());
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ds.status().message().find("shard_1.bin' is 42 bytes, 40 when the job was submitted"), std::string::npos)
      << ds.status();
}

TEST_F(DatasetTest, TensorShards_RowsReadAcrossShardsAsSaved) {
  CopyShards("rows");  // rows 0-4, 5-7, 8-11: inputs [r, r + 0.5, r + 0.25], targets r
  DatasetSpec spec;
  spec.set_path((root_ / "shards").string());
  spec.set_shuffle(true);
  auto index = IndexDataset(spec, {"x"}, 4, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_FALSE(index->tokens());
  EXPECT_EQ(index->samples(), 12);
  EXPECT_EQ(index->shards(1).rows(), 3);
  auto ds = Dataset::Open(spec, *index, {"x"}, {0}, true, 4, /*seed=*/5, Roots());
  ASSERT_TRUE(ds.ok()) << ds.status();
  Sampler sampler(12, 4, true, 5);
  std::map<int64_t, int> seen;
  for (int64_t step = 0; step < 3; ++step) {
    absl::StatusOr<Batch> b = (*ds)->Read(step, 4, 0, 1);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::vector<int64_t> want = sampler.Indices(step);
    const at::Tensor x = b->inputs[0].toTensor(), y = b->target.toTensor();
    ASSERT_EQ(x.sizes(), (std::vector<int64_t>{4, 3}));
    for (int64_t j = 0; j < 4; ++j) {
      const float r = static_cast<float>(want[static_cast<size_t>(j)]);
      EXPECT_EQ(x[j][0].item<float>(), r);
      EXPECT_EQ(x[j][1].item<float>(), r + 0.5f);
      EXPECT_EQ(x[j][2].item<float>(), r + 0.25f);
      EXPECT_EQ(y[j].item<int64_t>(), want[static_cast<size_t>(j)]);
      ++seen[y[j].item<int64_t>()];
    }
  }
  EXPECT_EQ(seen.size(), 12u);
}

TEST_F(DatasetTest, TensorShards_ColumnsThatDifferAreRefusedNamingTheShard) {
  CopyShards("mixed");  // a.pt float32, b.pt float64
  DatasetSpec spec;
  spec.set_path((root_ / "shards").string());
  auto index = IndexDataset(spec, {"x"}, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("b.pt' has input 'x' as float64[rows, 3] but"), std::string::npos)
      << index.status();
  EXPECT_NE(index.status().message().find("a.pt' has float32[rows, 3]"), std::string::npos) << index.status();
  // Not a torch.save file.
  fs::remove(root_ / "shards" / "b.pt");
  { std::ofstream(root_ / "shards" / "b.pt") << "not a zip"; }
  index = IndexDataset(spec, {"x"}, 2, Roots());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("b.pt': not a file written by torch.save"), std::string::npos)
      << index.status();
}

TEST_F(DatasetTest, TensorShards_InputsByArgumentName) {
  CopyShards("named");
  DatasetSpec spec;
  spec.set_path((root_ / "shards").string());
  auto index = IndexDataset(spec, {"x"}, 4, Roots());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->samples(), 8);
  auto ds = Dataset::Open(spec, *index, {"x"}, {0}, false, 4, 0, Roots());
  ASSERT_TRUE(ds.ok()) << ds.status();
  absl::StatusOr<Batch> b = (*ds)->Read(1, 4, 0, 1);  // rows 4..7, across the two shards
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->target.isNone());
  const at::Tensor x = b->inputs[0].toTensor();
  for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(x[j][1].item<float>(), static_cast<float>(4 + j) + 0.5f);
  // A model whose argument is named otherwise.
  EXPECT_FALSE(IndexDataset(spec, {"y"}, 4, Roots()).ok());
}

}  // namespace
}  // namespace pippy::stage
