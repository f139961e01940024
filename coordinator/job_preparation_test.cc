// The record-by-record preparation (torchio/model_records.h: a skeleton split, one
// stage's records at a time) against the whole-model one, for every zoo model and
// 2, 3 and 4 stages: the same plan and layout, stage files with the same parameters
// and buffers bit for bit, and the same output through the stages.
#include "coordinator/job_preparation.h"

#include <filesystem>
#include <map>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pipeline/partition/merge.h"
#include "pipeline/partition/pipe.h"
#include "pipeline/partition/plan_builder.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::coordinator {
namespace {

namespace fs = std::filesystem;
const std::string kZoo = "examples/models/zoo/";

std::string Folder(const std::string& name, const std::string& model) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/prep_", name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kZoo + model + ".pt", dir + "/model.pt");
  fs::copy_file(kZoo + model + ".data.pt", dir + "/data.pt");
  return dir;
}

// A forward-only job of `stages` stages, 2 micro-batches of 2 rows (a loss-free split).
JobSpec InferenceSpec(int stages) {
  JobSpec spec;
  spec.mutable_split()->set_stages(stages);
  spec.mutable_schedule()->set_kind(SCHEDULE_INFERENCE);
  spec.mutable_schedule()->set_microbatches(2);
  spec.set_mode(MODE_INFERENCE);
  spec.set_steps(1);
  spec.set_batch_size(4);
  return spec;
}

// The stages in `dir` (as prepared) run on the job's first micro-batch: the output.
c10::IValue RunStages(const std::string& dir, const PipelinePlan& plan, const JobSpec& spec) {
  partition::Pipe pipe;
  pipe.plan = plan;
  for (int s = 0; s < plan.stages_size(); ++s) {
    auto m = torchio::LoadModel(absl::StrCat(dir, "/stage_", s, ".pt"));
    EXPECT_TRUE(m.ok()) << m.status();
    pipe.stages.push_back(*m);
  }
  auto model = torchio::LoadModel(dir + "/model.pt");
  std::ifstream f(dir + "/data.pt", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), {});
  auto names = torchio::ForwardArgumentNames(*model);
  auto data = stage::DataSource::FromBytes(bytes, names);
  EXPECT_TRUE(data.ok()) << data.status();
  auto mbs = stage::SplitIntoMicrobatches(data->Inputs(0, spec.batch_size()), spec.schedule().microbatches(), {},
                                          names);
  EXPECT_TRUE(mbs.ok()) << mbs.status();
  c10::IValue out;
  auto ran = partition::RunExample(&pipe, (*mbs)[0], 1, {}, &out);
  EXPECT_TRUE(ran.ok()) << ran.status();
  return out;
}

// Outputs equal bit for bit, through tuples and lists.
bool Same(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) return torch::equal(a.toTensor(), b.toTensor());
  if ((a.isTuple() && b.isTuple()) || (a.isList() && b.isList())) {
    const std::vector<c10::IValue> va = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const std::vector<c10::IValue> vb = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (va.size() != vb.size()) return false;
    for (size_t i = 0; i < va.size(); ++i) {
      if (!Same(va[i], vb[i])) return false;
    }
    return true;
  }
  return false;  // the zoo's outputs are tensors, tuples and lists of them
}

TEST(JobPreparationTest, ByRecords_EqualsTheWholeModelsSplit_ForEveryZooModel) {
  torch::jit::setGraphExecutorOptimize(false);
  int compared = 0;
  for (const std::string model : {"mlp", "mlp_marked", "cnn_bn", "gpt", "iface", "multi", "unet"}) {
    for (int k : {2, 3, 4}) {
      const std::string what = absl::StrCat(model, ", ", k, " stages");
      JobSpec spec = InferenceSpec(k);
      spec.set_name(model);
      const std::string a = Folder(absl::StrCat(model, k, "_records"), model);
      const std::string b = Folder(absl::StrCat(model, k, "_whole"), model);
      PrepareOptions whole;
      whole.whole = true;
      absl::StatusOr<PreparedJob> by_records = PrepareJob(spec, a);
      absl::StatusOr<PreparedJob> loaded = PrepareJob(spec, b, whole);
      if (!loaded.ok()) {  // more stages than legal cuts: refused alike
        ASSERT_FALSE(by_records.ok()) << what;
        EXPECT_EQ(by_records.status(), loaded.status()) << what;
        continue;
      }
      ASSERT_TRUE(by_records.ok()) << what << ": " << by_records.status();
      EXPECT_EQ(by_records->plan.SerializeAsString(), loaded->plan.SerializeAsString()) << what;
      EXPECT_EQ(by_records->layout.SerializeAsString(), loaded->layout.SerializeAsString()) << what;
      EXPECT_EQ(by_records->share_bytes, loaded->share_bytes) << what;
      for (int s = 0; s < k; ++s) {
        auto ma = torchio::LoadModel(absl::StrCat(a, "/stage_", s, ".pt"));
        auto mb = torchio::LoadModel(absl::StrCat(b, "/stage_", s, ".pt"));
        ASSERT_TRUE(ma.ok() && mb.ok()) << what;
        std::vector<std::pair<std::string, at::Tensor>> ta, tb;
        for (const auto& p : ma->named_attributes(true)) {
          if (p.value.isTensor()) ta.emplace_back(p.name, p.value.toTensor());
        }
        for (const auto& p : mb->named_attributes(true)) {
          if (p.value.isTensor()) tb.emplace_back(p.name, p.value.toTensor());
        }
        ASSERT_EQ(ta.size(), tb.size()) << what << " stage " << s;
        for (size_t i = 0; i < ta.size(); ++i) {
          EXPECT_EQ(ta[i].first, tb[i].first) << what;
          EXPECT_TRUE(ta[i].second.defined() == tb[i].second.defined() &&
                      (!ta[i].second.defined() || torch::equal(ta[i].second, tb[i].second)))
              << what << " stage " << s << " " << ta[i].first;
        }
      }
      c10::IValue oa = RunStages(a, by_records->plan, spec);
      c10::IValue ob = RunStages(b, loaded->plan, spec);
      EXPECT_TRUE(!oa.isNone() && Same(oa, ob)) << what;
      ++compared;
    }
  }
  EXPECT_GE(compared, 14);  // most models split 2, 3 and 4 ways
}

// The zoo's MLP with its first storage record changed by `edit` (Python: the record's
// bytes -> the bytes to write, or None to leave it out; "twice" writes it twice).
absl::StatusOr<PreparedJob> PrepareEdited(const std::string& name, const std::string& edit) {
  const std::string dir = Folder(name, "mlp");
  const std::string script = absl::StrCat(
      "import zipfile, warnings\n"
      "warnings.simplefilter('ignore')\n"
      "src = zipfile.ZipFile('", dir, "/model.pt')\n"
      "names = src.namelist()\n"
      "victim = sorted(n for n in names if '/data/' in n and not n.endswith('.pkl'))[0]\n"
      "with zipfile.ZipFile('", dir, "/edited.pt', 'w', zipfile.ZIP_STORED) as out:\n"
      "    for n in names:\n"
      "        data = src.read(n)\n"
      "        if n != victim:\n"
      "            out.writestr(n, data)\n"
      "            continue\n"
      "        ", edit, "\n");
  std::ofstream(dir + "/edit.py") << script;
  if (std::system(absl::StrCat("/usr/bin/python3 ", dir, "/edit.py").c_str()) != 0) {
    return absl::InternalError("the edit script failed");
  }
  fs::rename(dir + "/edited.pt", dir + "/model.pt");
  absl::StatusOr<PreparedJob> r = PrepareJob(InferenceSpec(2), dir);
  EXPECT_FALSE(fs::exists(dir + "/stage_0.pt")) << name << ": a stage was written";
  return r;
}

TEST(JobPreparationTest, ByRecords_RefusesBadStorageRecords_NamingThem_BeforeWritingAnyStage) {
  struct Case {
    std::string name, edit, want;
  };
  const std::vector<Case> cases = {
      {"short", "out.writestr(n, data[:8])", "but holds only 8"},
      {"missing", "pass", "failed locating file data/0"},
      {"twice", "out.writestr(n, data); out.writestr(n, data)", "is listed twice"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PreparedJob> r = PrepareEdited(absl::StrCat("bad_record_", c.name), c.edit);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.want), absl::string_view::npos) << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find("data/"), absl::string_view::npos) << c.name << ": names the record? "
                                                                            << r.status();
  }
}

}  // namespace
}  // namespace pippy::coordinator

namespace pippy::coordinator {
namespace {

TEST(JobPreparationTest, MergeByRecords_EqualsTheWholeMerge) {
  torch::jit::setGraphExecutorOptimize(false);
  for (const std::string model : {"mlp", "cnn_bn", "gpt"}) {
    const std::string dir = Folder(absl::StrCat("merge_", model), model);
    ASSERT_TRUE(PrepareJob(InferenceSpec(2), dir).ok()) << model;
    // "Trained" stages: every parameter and buffer doubled.
    std::map<int, std::string> results;
    for (int s = 0; s < 2; ++s) {
      auto stage = torchio::LoadModel(absl::StrCat(dir, "/stage_", s, ".pt"));
      ASSERT_TRUE(stage.ok());
      torch::NoGradGuard no_grad;
      for (const auto& p : stage->named_parameters(true)) p.value.mul_(2);
      for (const auto& b : stage->named_buffers(true)) {
        if (b.value.is_floating_point()) b.value.mul_(2);
      }
      results[s] = absl::StrCat(dir, "/result_", s, ".pt");
      ASSERT_TRUE(torchio::SaveModule(*stage, results[s]).ok());
    }
    ASSERT_TRUE(partition::MergeStagesByRecords(dir + "/model.pt", results, dir + "/by_records.pt").ok()) << model;
    ASSERT_TRUE(partition::MergeStagesIntoModel(dir + "/model.pt", results, dir + "/whole.pt").ok()) << model;
    auto a = torchio::LoadModel(dir + "/by_records.pt");
    auto b = torchio::LoadModel(dir + "/whole.pt");
    auto original = torchio::LoadModel(dir + "/model.pt");
    ASSERT_TRUE(a.ok() && b.ok() && original.ok()) << model;
    std::map<std::string, at::Tensor> tb, to;
    for (const auto& x : b->named_attributes(true)) {
      if (x.value.isTensor()) tb[x.name] = x.value.toTensor();
    }
    for (const auto& x : original->named_parameters(true)) to[x.name] = x.value;
    int params = 0;
    for (const auto& x : a->named_attributes(true)) {
      if (!x.value.isTensor()) continue;
      ASSERT_TRUE(tb.count(x.name)) << model << " " << x.name;
      EXPECT_TRUE(torch::equal(x.value.toTensor(), tb[x.name])) << model << " " << x.name;
      if (to.count(x.name)) {
        EXPECT_TRUE(torch::equal(x.value.toTensor(), to[x.name] * 2)) << model << " " << x.name;
        ++params;
      }
    }
    EXPECT_EQ(params, static_cast<int>(to.size())) << model;
  }
}

}  // namespace
}  // namespace pippy::coordinator
