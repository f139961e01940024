// The partitioner's record of the tensors forward() writes in place (ParameterInfo.written):
// exactly a generation model's KV caches, not the parameters beside them (LibTorch's alias
// analysis would call every module attribute written once one is), and none of a model
// that writes nothing (the zoo's GPT, whose head and embedding share one tensor).
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "pipeline/partition/partition.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::partition {
namespace {

std::set<std::string> Written(const std::string& path, int stages) {
  auto m = torchio::LoadModel(path);
  EXPECT_TRUE(m.ok()) << m.status();
  SplitOptions o;
  o.num_stages = stages;
  auto pipe = SplitModel(*m, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  std::set<std::string> out;
  if (!pipe.ok()) return out;
  for (const StagePlan& st : pipe->plan.stages()) {
    for (const ParameterInfo& p : st.parameters()) {
      if (p.written()) out.insert(p.name());
    }
  }
  return out;
}

TEST(WrittenBuffers, AreTheKvCachesOfAGenerationModel) {
  std::set<std::string> want;
  for (int b = 0; b < 4; ++b) {
    want.insert("blocks." + std::to_string(b) + ".attn.k_cache");
    want.insert("blocks." + std::to_string(b) + ".attn.v_cache");
  }
  EXPECT_EQ(Written("examples/models/gen/gen_lm.pt", 2), want);
  EXPECT_EQ(Written("examples/models/gen/gen_lm.pt", 3), want);
}

TEST(WrittenBuffers, NoneInAModelThatWritesNothing) {
  EXPECT_TRUE(Written("examples/models/zoo/gpt.pt", 2).empty());
  EXPECT_TRUE(Written("examples/models/zoo/llama.pt", 2).empty());
}

}  // namespace
}  // namespace pippy::partition
