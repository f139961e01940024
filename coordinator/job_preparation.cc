#include "coordinator/job_preparation.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/model_check.h"
#include "common/torch_status.h"
#include "coordinator/artifact_store.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/forward_probe.h"
#include "pipeline/partition/partition.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/stage/synthetic_data.h"
#include "pipeline/stage/training.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::coordinator {
namespace {

absl::Status Field(absl::string_view field, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code() == absl::StatusCode::kInternal ? s.code() : absl::StatusCode::kInvalidArgument,
                      absl::StrCat(field, ": ", s.message()));
}

template <typename T>
absl::StatusOr<T> Field(absl::string_view field, absl::StatusOr<T> v) {
  if (v.ok()) return v;
  return Field(field, v.status());
}

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// The data's bytes: the uploaded file, or made from the synthetic spec.
absl::StatusOr<std::string> DataBytes(const JobSpec& spec, const std::string& dir) {
  const std::string path = dir + "/data.pt";
  const bool have_file = std::filesystem::exists(path);
  if (have_file && !spec.data().synthetic().empty()) {
    return Bad("data", "give a data file or a synthetic spec, not both");
  }
  if (have_file) return torchio::ReadFile(path);
  if (spec.data().synthetic().empty()) {
    return Bad("data", "missing: send a torch.save({\"inputs\": ..., \"targets\": ...}) file or a synthetic spec");
  }
  std::string synthetic = spec.data().synthetic();
  if (!absl::StrContains(synthetic, "seed=")) absl::StrAppend(&synthetic, ";seed=", spec.seed());
  return stage::MakeSyntheticData(synthetic);
}

class StagesInMemory : public PreparedStages {
 public:
  // The model is kept with its stages: their graphs use types (named tuples, classes)
  // that live in the model's compilation unit. Its tensors are the stages' anyway.
  StagesInMemory(torch::jit::Module model, std::vector<torch::jit::Module> stages)
      : model_(std::move(model)), stages_(std::move(stages)) {}
  int size() const override { return static_cast<int>(stages_.size()); }

  absl::Status Write(int stage, const std::function<absl::Status(absl::string_view)>& sink) const override {
    return torchio::WriteModule(stages_.at(static_cast<size_t>(stage)), sink);
  }

  absl::StatusOr<std::vector<int64_t>> WriteFiles(const std::string& dir) const override {
    // Serialising a stage is memory-bound: a few at a time, not one per stage.
    const size_t parallel = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
    std::vector<int64_t> sizes(stages_.size(), 0);
    std::vector<absl::Status> results(stages_.size());
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (size_t t = 0; t < std::min(parallel, stages_.size()); ++t) {
      threads.emplace_back([&] {
        for (size_t s = next++; s < stages_.size(); s = next++) {
          const std::string path = absl::StrCat(dir, "/", ArtifactStore::StageFileName(static_cast<int>(s)));
          results[s] = torchio::SaveModule(stages_[s], path);
          sizes[s] = ArtifactStore::FileSize(path);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : results) PIPPY_RETURN_IF_ERROR(s);
    return sizes;
  }

 private:
  const torch::jit::Module model_;
  const std::vector<torch::jit::Module> stages_;
};

// The submitted model, loaded in a child process first (options.model_checker) and
// then here; errors name it as the user knows it ('model'), not by the coordinator's file.
absl::StatusOr<torch::jit::Module> LoadChecked(const std::string& dir, const PrepareOptions& options) {
  const std::string model_path = dir + "/model.pt";
  if (ArtifactStore::FileSize(model_path) <= 0) return Bad("model", "empty: send the TorchScript file's bytes");
  absl::Status checked = absl::OkStatus();
  if (!options.model_checker.empty()) {
    const std::string data_path = dir + "/data.pt";
    ModelCheckError c = CheckModelInChild(options.model_checker, model_path,
                                          std::filesystem::exists(data_path) ? data_path : "",
                                          options.model_check_timeout);
    if (c.status.code() == absl::StatusCode::kUnavailable) return c.status;
    if (c.field == ModelCheckError::kData && !c.status.ok()) {
      // DataSource's own errors start with "data"; a crash or a hang does not.
      if (absl::StartsWith(c.status.message(), "data")) return c.status;
      return Bad("data", c.status.message());
    }
    checked = c.status;
  }
  absl::StatusOr<torch::jit::Module> loaded =
      checked.ok() ? torchio::LoadModel(model_path) : absl::StatusOr<torch::jit::Module>(checked);
  if (loaded.ok()) return loaded;
  std::string msg(loaded.status().message());
  msg = absl::StrReplaceAll(msg, {{absl::StrCat("'", model_path, "'"), "'model'"}});
  return Bad("model", msg);
}

// The job's data, checked against the model: one micro-batch through its forward
// (and the loss, for training). Returns the data; `example` gets that micro-batch.
absl::StatusOr<stage::DataSource> CheckedData(const JobSpec& spec, const std::string& dir,
                                              torch::jit::Module& model, std::vector<c10::IValue>* example) {
  const bool train = spec.mode() == MODE_TRAIN;
  PIPPY_ASSIGN_OR_RETURN(std::string data_bytes, DataBytes(spec, dir));
  const std::vector<std::string> names = torchio::ForwardArgumentNames(model);
  absl::StatusOr<stage::DataSource> data_or = spec.has_serving()
                                                  ? stage::DataSource::FromExampleBytes(data_bytes, names)
                                                  : stage::DataSource::FromBytes(data_bytes, names);
  PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, std::move(data_or));
  std::string().swap(data_bytes);
  if (train && !data.has_targets()) return Bad("data", "training needs \"targets\" in the data file");
  if (!train && static_cast<int64_t>(spec.steps()) * spec.batch_size() > data.num_samples() * 64) {
    return Bad("steps", "an inference job reads each sample at most a few times; lower steps or batch_size");
  }
  const int m = spec.schedule().microbatches();
  PIPPY_ASSIGN_OR_RETURN(auto mb_inputs, Field("data", stage::SplitIntoMicrobatches(
                                                           data.Inputs(0, spec.batch_size()), m, {}, names)));
  *example = mb_inputs[0];
  absl::StatusOr<c10::IValue> output = partition::RunForwardOnce(model, *example);
  if (!output.ok()) return Field("data: the inputs do not fit the model", output.status());
  if (train) {
    PIPPY_ASSIGN_OR_RETURN(auto mb_targets, Field("data", stage::SplitIntoMicrobatches(
                                                               {data.Target(0, spec.batch_size())}, m, {}, {"targets"})));
    torch::NoGradGuard no_grad;
    absl::StatusOr<at::Tensor> loss = stage::ComputeLoss(spec.loss(), model, *output, mb_targets[0][0]);
    if (!loss.ok()) return Field("data: the targets do not fit the model's output", loss.status());
  }
  return data;
}

// Each rank's share of the data, written into `dir`; their sizes. A serving job's
// example is not served (requests bring the inputs): its shares are empty.
absl::StatusOr<std::vector<int64_t>> WriteShares(const JobSpec& spec, const JobLayout& layout,
                                                 const stage::DataSource& data, const std::string& dir) {
  std::vector<int64_t> sizes;
  for (int r = 0; r < layout.ranks_size(); ++r) {
    const RankLayout& piece = layout.ranks(r);
    std::vector<int> inputs;
    if (!spec.has_serving()) inputs.assign(piece.model_inputs().begin(), piece.model_inputs().end());
    PIPPY_ASSIGN_OR_RETURN(std::string share, data.ShareBytes(inputs, piece.targets() && !spec.has_serving()));
    const std::string path = absl::StrCat(dir, "/", ArtifactStore::ShareFileName(r));
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(share.data(), static_cast<std::streamsize>(share.size()));
    f.close();
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
    sizes.push_back(static_cast<int64_t>(share.size()));
  }
  return sizes;
}

}  // namespace

absl::StatusOr<PreparedJob> PrepareJob(const JobSpec& submitted, const std::string& dir,
                                       const PrepareOptions& options) {
  PreparedJob out;
  out.spec = submitted;
  const JobSpec& spec = out.spec;
  PIPPY_RETURN_IF_ERROR(job::CheckSpec(&out.spec));
  torch::jit::setGraphExecutorOptimize(false);
  const absl::Time start = absl::Now();
  PIPPY_ASSIGN_OR_RETURN(torch::jit::Module model, LoadChecked(dir, options));
  const absl::Time loaded_at = absl::Now();
  std::vector<c10::IValue> example;
  PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, CheckedData(spec, dir, model, &example));
  const absl::Time checked_at = absl::Now();
  // Split once; the stages share the model's tensors (they are only written out).
  partition::SplitOptions so;
  so.num_stages = spec.split().stages();
  so.split_at.assign(spec.split().split_at().begin(), spec.split().split_at().end());
  so.balance = spec.split().balance();
  so.example_inputs = example;
  so.share_tensors = true;
  so.model_name = spec.name();
  absl::StatusOr<partition::Pipe> pipe = partition::SplitModel(model, so);
  if (!pipe.ok()) return Field("split", pipe.status());
  out.plan = pipe->plan;
  PIPPY_ASSIGN_OR_RETURN(out.layout, job::MakeLayout(spec, out.plan));
  const absl::Time split_at = absl::Now();
  out.stages = std::make_shared<StagesInMemory>(model, std::move(pipe->stages));
  PIPPY_ASSIGN_OR_RETURN(out.share_bytes, WriteShares(spec, out.layout, data, dir));
  log::Info("prepared a submission in {}: model loaded in {}, data checked in {}, split into {} stages in {}, {} "
            "data shares written in {}",
            absl::FormatDuration(absl::Now() - start), absl::FormatDuration(loaded_at - start),
            absl::FormatDuration(checked_at - loaded_at), out.plan.stages_size(),
            absl::FormatDuration(split_at - checked_at), out.share_bytes.size(),
            absl::FormatDuration(absl::Now() - split_at));
  return out;
}

}  // namespace pippy::coordinator
