#include "coordinator/job_preparation.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/child_process.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "common/torch_status.h"
#include "coordinator/artifact_store.h"
#include "pipeline/autoplan/chooser.h"
#include "pipeline/autoplan/profile.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/torchio/model_records.h"
#include "pipeline/partition/plan_builder.h"
#include "pipeline/partition/forward_probe.h"
#include "pipeline/partition/partition.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/dataset.h"
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

// Where the preparation says which phase it is in (child_process.h: AnnouncePhase).
using Phase = std::function<void(absl::string_view)>;

uint64_t InputBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const char* f : {"/model.pt", "/data.pt"}) n += static_cast<uint64_t>(std::max<int64_t>(0, ArtifactStore::FileSize(dir + f)));
  return n;
}
uint64_t HeapCap(const std::string& dir) { return ChildHeapCap(InputBytes(dir)); }

std::string HeapCapText(const std::string& dir) {
  return absl::StrCat("the preparation may use ", HeapCap(dir) >> 20, " MiB: 2 GiB plus ", kChildHeapFactor,
                      " x the model and data files");
}

bool OutOfMemory(const absl::Status& s) {
  return absl::StrContains(s.message(), "can't allocate memory") || absl::StrContains(s.message(), "bad_alloc");
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

// Every stage written to `dir`/stage_<s>.pt, a few at a time (serialising a stage is
// memory-bound: not one thread per stage); their sizes.
absl::StatusOr<std::vector<int64_t>> WriteStageFiles(const std::vector<torch::jit::Module>& stages,
                                                     const std::string& dir) {
  const size_t parallel = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  std::vector<int64_t> sizes(stages.size(), 0);
  std::vector<absl::Status> results(stages.size());
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < std::min(parallel, stages.size()); ++t) {
    threads.emplace_back([&] {
      for (size_t s = next++; s < stages.size(); s = next++) {
        const std::string path = absl::StrCat(dir, "/", ArtifactStore::StageFileName(static_cast<int>(s)));
        results[s] = torchio::SaveModule(stages[s], path);
        sizes[s] = ArtifactStore::FileSize(path);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) PIPPY_RETURN_IF_ERROR(s);
  return sizes;
}

// The submitted model; errors name it as the user knows it ('model'), not by the
// coordinator's file.
absl::StatusOr<torch::jit::Module> LoadSubmitted(const std::string& dir) {
  const std::string model_path = dir + "/model.pt";
  absl::StatusOr<torch::jit::Module> loaded = torchio::LoadModel(model_path);
  if (loaded.ok()) return loaded;
  std::string msg(loaded.status().message());
  msg = absl::StrReplaceAll(msg, {{absl::StrCat("'", model_path, "'"), "'model'"}});
  return Bad("model", msg);
}

// The job's data and its first micro-batch (inputs, and targets for training); the
// spec with its steps resolved (a job given in epochs).
struct JobData {
  JobSpec spec;
  std::optional<stage::DataSource> data;  // a data file or synthetic data
  std::optional<DatasetLayout> dataset;   // or a dataset, indexed
  std::optional<DatasetLayout> eval_dataset;  // the validation dataset (spec.eval), indexed
  std::vector<c10::IValue> example;
  c10::IValue target;  // training only
  int64_t samples = 0;
};

// The dataset indexed and its first batch read, as the ranks will read it.
absl::Status ReadDataset(const std::vector<std::string>& names, const PrepareOptions& options, JobData* d,
                         stage::Batch* first) {
  JobSpec& spec = d->spec;
  const DatasetSpec& ds = spec.data().dataset();
  PIPPY_ASSIGN_OR_RETURN(DatasetLayout index,
                         stage::IndexDataset(ds, names, spec.batch_size(), options.dataset_roots));
  if (spec.epochs() > 0) {
    index.set_epochs(spec.epochs());
    const int64_t steps = static_cast<int64_t>(spec.epochs()) * index.steps_per_epoch();
    if (steps > (int64_t{1} << 30)) return Bad("epochs", absl::StrCat(spec.epochs(), " epochs are ", steps, " steps"));
    spec.set_steps(static_cast<int>(steps));
    spec.set_epochs(0);
    PIPPY_RETURN_IF_ERROR(job::CheckSpec(&spec));  // the warm-up against the steps
  }
  std::vector<int> all(names.size());
  for (size_t i = 0; i < names.size(); ++i) all[i] = static_cast<int>(i);
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<stage::Dataset> reader,
                         stage::Dataset::Open(ds, index, names, all, spec.mode() == MODE_TRAIN, spec.batch_size(),
                                              spec.seed(), options.dataset_roots));
  PIPPY_ASSIGN_OR_RETURN(*first, reader->Read(0, spec.batch_size(), 0, 1));
  d->samples = index.samples();
  d->dataset = std::move(index);
  return absl::OkStatus();
}

// A value's dtype and shape, "int64[8, 16]" (a tuple's or list's elements in brackets).
std::string Describe(const c10::IValue& v) {
  if (v.isTensor()) {
    return absl::StrCat(c10::toString(v.toTensor().scalar_type()), "[", absl::StrJoin(v.toTensor().sizes(), ", "), "]");
  }
  std::vector<std::string> parts;
  if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) parts.push_back(Describe(e));
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) parts.push_back(Describe(e));
  } else {
    return v.tagKind();
  }
  return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
}

// The validation dataset (spec.eval) indexed, its batches resolved into the spec, and
// its first batch checked against the training data's (`train_first`).
absl::Status ReadEvalDataset(const std::vector<std::string>& names, const PrepareOptions& options,
                             const stage::Batch& train_first, JobData* d) {
  JobSpec& spec = d->spec;
  const DatasetSpec& ds = spec.eval().dataset();
  absl::StatusOr<DatasetLayout> index = stage::IndexDataset(ds, names, spec.batch_size(), options.dataset_roots);
  if (!index.ok()) {
    return absl::Status(index.status().code(), absl::StrCat("eval.", index.status().message()));
  }
  const int64_t have = index->steps_per_epoch();
  const int64_t want = spec.eval().batches() > 0 ? spec.eval().batches() : std::min<int64_t>(100, have);
  if (want > have) {
    return Bad("eval.batches", absl::StrCat(want, " batches of ", spec.batch_size(), " samples, but the validation "
                                            "dataset '", ds.path(), "' holds ", index->samples(), " samples (",
                                            have, " batches)"));
  }
  index->set_steps_per_epoch(want);
  index->set_epochs(0);
  std::vector<int> all(names.size());
  for (size_t i = 0; i < names.size(); ++i) all[i] = static_cast<int>(i);
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<stage::Dataset> reader,
                         stage::Dataset::Open(ds, *index, names, all, /*with_targets=*/true, spec.batch_size(),
                                              spec.seed(), options.dataset_roots));
  absl::StatusOr<stage::Batch> first = reader->Read(0, spec.batch_size(), 0, 1);
  if (!first.ok()) return absl::Status(first.status().code(), absl::StrCat("eval.", first.status().message()));
  for (size_t i = 0; i < names.size() && i < first->inputs.size() && i < train_first.inputs.size(); ++i) {
    const std::string got = Describe(first->inputs[i]), want_text = Describe(train_first.inputs[i]);
    if (got != want_text) {
      return Bad("eval.dataset", absl::StrCat("'", ds.path(), "' gives input '", names[i], "' as ", got,
                                              " per batch, the training data as ", want_text));
    }
  }
  if (first->target.isNone()) return Bad("eval.dataset", absl::StrCat("'", ds.path(), "' has no targets"));
  if (Describe(first->target) != Describe(train_first.target)) {
    return Bad("eval.dataset", absl::StrCat("'", ds.path(), "' gives targets as ", Describe(first->target),
                                            " per batch, the training data as ", Describe(train_first.target)));
  }
  spec.mutable_eval()->set_batches(static_cast<int32_t>(want));
  d->eval_dataset = std::move(*index);
  return absl::OkStatus();
}

// d->example and d->target (a whole batch) replaced by their first of `m` micro-batches.
absl::Status TakeFirstMicrobatch(int m, const std::vector<std::string>& names, JobData* d) {
  const char* field = d->dataset ? "dataset" : "data";
  PIPPY_ASSIGN_OR_RETURN(auto mb_inputs, Field(field, stage::SplitIntoMicrobatches(d->example, m, {}, names)));
  if (d->spec.mode() == MODE_TRAIN) {
    PIPPY_ASSIGN_OR_RETURN(auto mb_targets,
                           Field(field, stage::SplitIntoMicrobatches({d->target}, m, {}, {"targets"})));
    d->target = mb_targets[0][0];
  }
  d->example = mb_inputs[0];
  return absl::OkStatus();
}

// The job's data; its example and target are the first micro-batch, or with
// `whole_batch` the whole first batch (an auto plan measures on it and then takes its
// first micro-batch: TakeFirstMicrobatch).
absl::StatusOr<JobData> ReadData(const JobSpec& spec, const std::string& dir, const torch::jit::Module& model,
                                 const Phase& phase, const PrepareOptions& options, bool whole_batch = false) {
  const bool train = spec.mode() == MODE_TRAIN;
  phase("data");
  JobData d;
  d.spec = spec;
  const std::vector<std::string> names = torchio::ForwardArgumentNames(model);
  stage::Batch first;
  if (!spec.data().dataset().path().empty()) {
    if (std::filesystem::exists(dir + "/data.pt")) return Bad("data", "give a dataset or a data file, not both");
    PIPPY_RETURN_IF_ERROR(ReadDataset(names, options, &d, &first));
    if (train && first.target.isNone()) {
      return Bad("dataset", "training needs targets: the tensor shards have no \"targets\"");
    }
  } else {
    PIPPY_ASSIGN_OR_RETURN(std::string data_bytes, DataBytes(spec, dir));
    absl::StatusOr<stage::DataSource> data_or = spec.has_serving()
                                                    ? stage::DataSource::FromExampleBytes(data_bytes, names)
                                                    : stage::DataSource::FromBytes(data_bytes, names);
    PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, std::move(data_or));
    std::string().swap(data_bytes);
    if (train && !data.has_targets()) return Bad("data", "training needs \"targets\" in the data file");
    if (!train && static_cast<int64_t>(spec.steps()) * spec.batch_size() > data.num_samples() * 64) {
      return Bad("steps", "an inference job reads each sample at most a few times; lower steps or batch_size");
    }
    first = stage::Batch{data.Inputs(0, spec.batch_size()), data.Target(0, spec.batch_size())};
    if (spec.data().synthetic().empty()) d.samples = data.num_samples();
    d.data = std::move(data);
  }
  if (train && spec.has_eval()) PIPPY_RETURN_IF_ERROR(ReadEvalDataset(names, options, first, &d));
  d.example = std::move(first.inputs);
  d.target = std::move(first.target);
  if (!whole_batch) PIPPY_RETURN_IF_ERROR(TakeFirstMicrobatch(spec.schedule().microbatches(), names, &d));
  return d;
}

// The rows of the embedding that a token dataset's ids index: of each aten::embedding
// whose indices are the model's first input, as a stage reads it (the smallest if
// several). 0: none found (the ids go elsewhere first; unchecked).
int64_t TokenLimit(const partition::Pipe& pipe) {
  int64_t limit = 0;
  for (size_t s = 0; s < pipe.stages.size(); ++s) {
    const StagePlan& plan = pipe.plan.stages(static_cast<int>(s));
    const std::shared_ptr<torch::jit::Graph> graph = pipe.stages[s].get_method("forward").graph();
    for (int i = 0; i < plan.inputs_size(); ++i) {
      if (!plan.inputs(i).has_model_input() || plan.inputs(i).model_input() != 0) continue;
      if (static_cast<size_t>(i) + 1 >= graph->inputs().size()) continue;
      for (const torch::jit::Use& use : graph->inputs()[static_cast<size_t>(i) + 1]->uses()) {
        if (use.user->kind() != c10::Symbol::aten("embedding") || use.offset != 1) continue;
        // The weight: a GetAttr chain from self.
        std::vector<std::string> path;
        torch::jit::Value* v = use.user->input(0);
        while (v->node()->kind() == c10::prim::GetAttr) {
          path.insert(path.begin(), v->node()->s(c10::attr::name));
          v = v->node()->input(0);
        }
        if (v != graph->inputs()[0] || path.empty()) continue;
        torch::jit::Module m = pipe.stages[s];
        for (size_t k = 0; k + 1 < path.size(); ++k) m = m.attr(path[k]).toModule();
        const c10::IValue w = m.attr(path.back());
        if (!w.isTensor() || w.toTensor().dim() != 2) continue;
        const int64_t rows = w.toTensor().size(0);
        limit = limit == 0 ? rows : std::min(limit, rows);
      }
    }
  }
  return limit;
}

// The job's layout's data part: the samples, and a dataset's index for the ranks that read it.
void SetLayoutData(const JobData& d, const partition::Pipe* pipe, JobLayout* layout) {
  layout->set_data_samples(d.samples);
  if (d.eval_dataset) {
    DatasetLayout index = *d.eval_dataset;
    if (index.tokens() && pipe != nullptr) index.set_token_limit(TokenLimit(*pipe));
    *layout->mutable_eval_dataset() = index;
    for (RankLayout& piece : *layout->mutable_ranks()) {
      if (piece.model_inputs_size() > 0 || piece.targets()) *piece.mutable_eval_dataset() = index;
    }
  }
  if (!d.dataset) return;
  DatasetLayout index = *d.dataset;
  if (index.tokens() && pipe != nullptr) index.set_token_limit(TokenLimit(*pipe));
  *layout->mutable_dataset() = index;
  for (RankLayout& piece : *layout->mutable_ranks()) {
    if (piece.model_inputs_size() > 0 || piece.targets()) *piece.mutable_dataset() = index;
  }
}

// The model's output on the example, checked as the data's: errors name the data
// (or the memory cap); for training, the loss of the output against the targets.
absl::Status CheckOutput(const JobSpec& spec, const std::string& dir, torch::jit::Module& model,
                         const absl::StatusOr<c10::IValue>& output, const c10::IValue& target) {
  if (!output.ok() && OutOfMemory(output.status())) {
    return Bad("model", absl::StrCat("its forward ran out of memory on one micro-batch of the data (", HeapCapText(dir),
                                     "): ", output.status().message()));
  }
  if (!output.ok()) return Field("data: the inputs do not fit the model", output.status());
  if (spec.mode() != MODE_TRAIN) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  absl::StatusOr<at::Tensor> loss = stage::ComputeLoss(spec.loss(), model, *output, target);
  if (!loss.ok()) return Field("data: the targets do not fit the model's output", loss.status());
  return absl::OkStatus();
}

// Each rank's share of the data, written into `dir`; their sizes. A serving job's
// example is not served (requests bring the inputs): its shares are empty.
absl::StatusOr<std::vector<int64_t>> WriteShares(const JobSpec& spec, const JobLayout& layout,
                                                 const std::optional<stage::DataSource>& data, const std::string& dir) {
  std::vector<int64_t> sizes;
  for (int r = 0; r < layout.ranks_size(); ++r) {
    const RankLayout& piece = layout.ranks(r);
    std::vector<int> inputs;
    if (!spec.has_serving()) inputs.assign(piece.model_inputs().begin(), piece.model_inputs().end());
    std::string share;  // a dataset's ranks read it themselves: their shares are empty
    if (data) {
      PIPPY_ASSIGN_OR_RETURN(share, data->ShareBytes(inputs, piece.targets() && !spec.has_serving()));
    }
    const std::string path = absl::StrCat(dir, "/", ArtifactStore::ShareFileName(r));
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(share.data(), static_cast<std::streamsize>(share.size()));
    f.close();
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
    sizes.push_back(static_cast<int64_t>(share.size()));
  }
  return sizes;
}

partition::SplitOptions SplitOptionsOf(const JobSpec& spec) {
  partition::SplitOptions so;
  so.num_stages = spec.split().stages();
  so.split_at.assign(spec.split().split_at().begin(), spec.split().split_at().end());
  so.balance = spec.split().balance();
  so.share_tensors = true;  // the stages share the model's tensors (they are only written out)
  so.model_name = spec.name();
  return so;
}

// Record by record (torchio/model_records.h): the skeleton split, then one stage at a
// time its records read, the example micro-batch through it, its file written and its
// records let go. Memory: the code, one stage's tensors, one micro-batch's activations.
absl::StatusOr<PreparedJob> PrepareByRecords(const JobSpec& submitted, const std::string& dir, const Phase& phase,
                                             torchio::ModelRecords& records, const PrepareOptions& options) {
  PreparedJob out;
  const absl::Time start = absl::Now();
  torch::jit::Module& model = records.skeleton();
  PIPPY_ASSIGN_OR_RETURN(JobData d, ReadData(submitted, dir, model, phase, options));
  const JobSpec& spec = d.spec;
  out.spec = spec;
  phase("split");
  absl::StatusOr<partition::Pipe> pipe = partition::SplitModel(model, SplitOptionsOf(spec));
  if (!pipe.ok()) return Field("split", pipe.status());
  const absl::Time split_at = absl::Now();
  out.stage_bytes.assign(pipe->stages.size(), 0);
  absl::Status hook_error;
  partition::StageHooks hooks;
  hooks.before = [&](int s, const torch::jit::Module& stage) {
    phase("read");
    hook_error = Field("model", records.Materialize(stage));
    phase("probe");
    return hook_error;
  };
  hooks.after = [&](int s, const torch::jit::Module& stage) {
    phase("write");
    const std::string path = absl::StrCat(dir, "/", ArtifactStore::StageFileName(s));
    hook_error = torchio::SaveModule(stage, path);
    out.stage_bytes[static_cast<size_t>(s)] = ArtifactStore::FileSize(path);
    records.Dematerialize(stage);
    return hook_error;
  };
  c10::IValue output;
  absl::StatusOr<std::vector<double>> ran = partition::RunExample(&*pipe, d.example, 1, hooks, &output);
  if (!hook_error.ok()) return hook_error;
  PIPPY_RETURN_IF_ERROR(CheckOutput(spec, dir, model, ran.ok() ? absl::StatusOr<c10::IValue>(output) : ran.status(),
                                    d.target));
  out.plan = pipe->plan;
  PIPPY_ASSIGN_OR_RETURN(out.layout, job::MakeLayout(spec, out.plan));
  SetLayoutData(d, &*pipe, &out.layout);
  PIPPY_ASSIGN_OR_RETURN(out.share_bytes, WriteShares(spec, out.layout, d.data, dir));
  log::Info("prepared a submission record by record in {}: split into {} stages in {}, each stage read, run on "
            "the example and written in {}",
            absl::FormatDuration(absl::Now() - start), out.plan.stages_size(),
            absl::FormatDuration(split_at - start), absl::FormatDuration(absl::Now() - split_at));
  return out;
}

// The plan the spec leaves to pippy (autoplan::MeasureAndChoose), its errors named by
// the field; where the costs could not be measured, the defaults, logged.
absl::StatusOr<PlanChoice> ChooseFor(const JobSpec& spec, const torch::jit::Module& model,
                                     const std::vector<c10::IValue>& batch) {
  absl::StatusOr<PlanChoice> choice = autoplan::MeasureAndChoose(spec, model, batch);
  if (!choice.ok()) {
    const std::string msg(choice.status().message());
    return absl::InvalidArgumentError(absl::StartsWith(msg, "split.") ? msg : absl::StrCat("auto_plan: ", msg));
  }
  if (!choice->fallback().empty()) {
    log::Warn("auto plan: the model's costs could not be measured, using the defaults: {}", choice->fallback());
  }
  return choice;
}

// The whole model loaded: for what runs the whole model (--balance flops or time, a
// model with its own loss method, an auto plan) and archives the records path does not read.
absl::StatusOr<PreparedJob> PrepareWhole(const JobSpec& submitted, const std::string& dir, const Phase& phase,
                                         const PrepareOptions& options) {
  PreparedJob out;
  const absl::Time start = absl::Now();
  PIPPY_ASSIGN_OR_RETURN(torch::jit::Module model, LoadSubmitted(dir));
  const absl::Time loaded_at = absl::Now();
  // An auto plan measures the model on the whole first batch.
  const bool choose = job::PlanPending(submitted);
  PIPPY_ASSIGN_OR_RETURN(JobData d, ReadData(submitted, dir, model, phase, options, /*whole_batch=*/choose));
  std::optional<PlanChoice> choice;
  if (choose) {
    phase("profile");
    const std::vector<std::string> names = torchio::ForwardArgumentNames(model);
    PIPPY_ASSIGN_OR_RETURN(choice, ChooseFor(d.spec, model, d.example));
    autoplan::Apply(choice->candidates(0), &d.spec);
    PIPPY_RETURN_IF_ERROR(job::CheckSpec(&d.spec));
    PIPPY_RETURN_IF_ERROR(TakeFirstMicrobatch(d.spec.schedule().microbatches(), names, &d));
  }
  const JobSpec& spec = d.spec;
  out.spec = spec;
  const std::vector<c10::IValue>& example = d.example;
  phase("probe");
  PIPPY_RETURN_IF_ERROR(CheckOutput(spec, dir, model, partition::RunForwardOnce(model, example), d.target));
  const absl::Time checked_at = absl::Now();
  phase("split");
  partition::SplitOptions so = SplitOptionsOf(spec);
  so.example_inputs = example;
  if (choice && choice->fallback().empty() && spec.split().split_at().empty()) {
    so.cuts.assign(choice->candidates(0).cuts().begin(), choice->candidates(0).cuts().end());
    so.cuts_chosen = true;
  }
  absl::StatusOr<partition::Pipe> pipe = partition::SplitModel(model, so);
  if (!pipe.ok()) return Field("split", pipe.status());
  if (choice) *pipe->plan.mutable_choice() = *std::move(choice);
  // Tensor parallelism: the stage files are each stage's shards, stage_<s * T + t>.pt,
  // checked against the unsplit stages on the example micro-batch first.
  std::vector<torch::jit::Module> files = pipe->stages;
  if (spec.tensor_parallel().size() > 1) {
    tp::ShardOptions sharding;
    sharding.spec = spec.tensor_parallel();
    sharding.example_inputs = example;
    absl::StatusOr<std::vector<std::vector<torch::jit::Module>>> shards = tp::ShardPipe(&*pipe, sharding);
    if (!shards.ok()) return Field("split", shards.status());
    files.clear();
    for (const auto& stage : *shards) files.insert(files.end(), stage.begin(), stage.end());
  }
  out.plan = pipe->plan;
  PIPPY_ASSIGN_OR_RETURN(out.layout, job::MakeLayout(spec, out.plan));
  SetLayoutData(d, &*pipe, &out.layout);
  const absl::Time split_at = absl::Now();
  phase("write");
  PIPPY_ASSIGN_OR_RETURN(out.stage_bytes, WriteStageFiles(files, dir));
  PIPPY_ASSIGN_OR_RETURN(out.share_bytes, WriteShares(spec, out.layout, d.data, dir));
  log::Info("prepared a submission in {}: model loaded in {}, data checked in {}, split into {} stages in {}, stage "
            "files and {} data shares written in {}",
            absl::FormatDuration(absl::Now() - start), absl::FormatDuration(loaded_at - start),
            absl::FormatDuration(checked_at - loaded_at), out.plan.stages_size(),
            absl::FormatDuration(split_at - checked_at), out.share_bytes.size(),
            absl::FormatDuration(absl::Now() - split_at));
  return out;
}

// The preparation's work, wherever it runs; `spec` is already checked.
absl::StatusOr<PreparedJob> PrepareHere(const JobSpec& spec, const std::string& dir, const Phase& phase,
                                        const PrepareOptions& options) {
  const bool whole = options.whole;
  torch::jit::setGraphExecutorOptimize(false);
  phase("load");
  const Balance balance = spec.split().balance();
  // Tensor parallelism shards whole stages (and checks them on the example): the whole model.
  // An auto plan measures the whole model.
  if (!whole && (balance == BALANCE_UNSPECIFIED || balance == BALANCE_PARAMS) && spec.tensor_parallel().size() <= 1 &&
      !job::PlanPending(spec)) {
    absl::StatusOr<std::unique_ptr<torchio::ModelRecords>> records =
        torchio::ModelRecords::Open(dir + "/model.pt", "model");
    if (absl::IsInvalidArgument(records.status())) return Bad("model", records.status().message());
    // An archive the records path cannot read is loaded whole, which says what is wrong.
    // The model's own loss() may read its parameters: checked with the whole model.
    const bool own_loss = spec.mode() == MODE_TRAIN && spec.loss() == LOSS_MODEL;
    if (records.ok() && !own_loss) return PrepareByRecords(spec, dir, phase, **records, options);
    log::Info("preparing with the whole model loaded: {}",
              records.ok() ? "--loss model runs the model's own loss()" : std::string(records.status().message()));
  }
  return PrepareWhole(spec, dir, phase, options);
}

// PrepareHere, and a generation job's spec resolved against its plan.
absl::StatusOr<PreparedJob> PrepareAndResolve(const JobSpec& spec, const std::string& dir, const Phase& phase,
                                              const PrepareOptions& options) {
  PIPPY_ASSIGN_OR_RETURN(PreparedJob out, PrepareHere(spec, dir, phase, options));
  if (out.spec.serving().has_generation()) PIPPY_RETURN_IF_ERROR(job::ResolveGeneration(out.plan, &out.spec));
  return out;
}

constexpr char kSpecFile[] = "/job_spec.pb";
constexpr char kPlanFile[] = "/plan.pb";
constexpr char kLayoutFile[] = "/layout.pb";
constexpr char kPreparedSpecFile[] = "/prepared_spec.pb";  // the spec with its steps resolved

absl::Status WriteMessage(const google::protobuf::Message& m, const std::string& path) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f || !m.SerializeToOstream(&f)) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

absl::Status ReadMessage(const std::string& path, google::protobuf::Message* m) {
  std::ifstream f(path, std::ios::binary);
  if (!f || !m->ParseFromIstream(&f)) {
    return absl::InternalError(absl::StrCat("the preparation process left no readable '", path, "'"));
  }
  return absl::OkStatus();
}

// What each phase is, in messages about a child that crashed or ran out of time in it.
struct PhaseWords {
  const char* field;
  const char* doing;
  const char* crash_hint;
};
PhaseWords WordsFor(const std::string& phase) {
  if (phase == "data") {
    return {"data", "reading the data file", "the file is corrupt or was not written by torch.save"};
  }
  if (phase == "probe") {
    return {"model", "running its forward on one micro-batch of the data",
            "the model's code crashed LibTorch; run it once in PyTorch on the same inputs"};
  }
  if (phase == "split") {
    return {"split", "splitting the model (each stage's forward runs on one micro-batch)",
            "the model's code crashed LibTorch; run it once in PyTorch on the same inputs"};
  }
  if (phase == "profile") {
    return {"model", "measuring its forward and backward on the first batch (for the auto plan)",
            "the model's code crashed LibTorch; run it once in PyTorch on the same inputs, or give --stages, "
            "--schedule and --microbatches"};
  }
  if (phase == "write") return {"split", "writing the stage files", "report it with the coordinator's log"};
  return {"model", "loading the model",
          "the file is corrupt or was not written by torch.jit.save; save the model with "
          "torch.jit.script(model).save(path)"};
}

// The child's ending as the submission's error (OK: it finished).
absl::Status ChildStatus(const ChildResult& r, const std::string& dir) {
  using Ending = ChildResult::Ending;
  if (std::optional<absl::Status> plain = PlainEnding(r, "preparing the submission")) return *plain;
  const PhaseWords w = WordsFor(r.phase);
  switch (r.ending) {
    case Ending::kPhaseTimedOut:
      return Bad(w.field, absl::StrCat(w.doing, " did not finish within ", absl::FormatDuration(r.limit),
                                       " (--probe-timeout-s): a forward that does not return cannot run in a "
                                       "pipeline; check the model in PyTorch on the same inputs"));
    case Ending::kTimedOut:
      return Bad(w.field, absl::StrCat(w.doing, " did not finish within ", absl::FormatDuration(r.limit),
                                       " (--prepare-timeout-s: a corrupt file, or one too large for this "
                                       "coordinator)"));
    case Ending::kSignalled: {
      const int sig = r.signal;
      if (sig == SIGKILL) {
        return Bad(w.field, absl::StrCat("the preparation process was killed (SIGKILL) ", w.doing,
                                         ": the host ran out of memory? (", HeapCapText(dir), ")"));
      }
      log::Warn("preparing {}: LibTorch crashed with signal {} ({}) {}", dir, sig, strsignal(sig), w.doing);
      return Bad(w.field, absl::StrCat("LibTorch crashed (signal ", sig, ", ", strsignal(sig), ") ", w.doing, ": ",
                                       w.crash_hint));
    }
    default:
      return absl::InternalError("unreachable: PlainEnding words the other endings");
  }
}

absl::StatusOr<PreparedJob> PrepareInChild(const JobSpec& spec, const std::string& dir, const PrepareOptions& options) {
  PIPPY_RETURN_IF_ERROR(WriteMessage(spec, dir + kSpecFile));
  ChildSpec child;
  child.argv = {options.preparer, kPrepareFlag, dir};
  if (options.whole) child.argv.push_back(kWholeFlag);
  for (const std::string& root : options.dataset_roots) {
    child.argv.push_back(kDatasetRootFlag);
    child.argv.push_back(root);
  }
  child.timeout = options.timeout;
  child.phase_timeouts = {{"probe", options.probe_timeout}, {"split", options.probe_timeout},
                          {"profile", options.probe_timeout}};
  child.cancelled = options.cancelled;
  const absl::Time start = absl::Now();
  const ChildResult r = RunChild(child);
  PIPPY_RETURN_IF_ERROR(ChildStatus(r, dir));
  PreparedJob out;
  PIPPY_RETURN_IF_ERROR(ReadMessage(dir + kPreparedSpecFile, &out.spec));
  PIPPY_RETURN_IF_ERROR(ReadMessage(dir + kPlanFile, &out.plan));
  PIPPY_RETURN_IF_ERROR(ReadMessage(dir + kLayoutFile, &out.layout));
  // One file per stage, or per stage and shard (stage_<s * T + t>.pt).
  const int files = out.plan.stages_size() * std::max(1, out.plan.tensor_parallel().size());
  for (int s = 0; s < files; ++s) {
    const int64_t n = ArtifactStore::FileSize(absl::StrCat(dir, "/", ArtifactStore::StageFileName(s)));
    if (n <= 0) return absl::InternalError(absl::StrCat("the preparation process wrote no stage file ", s));
    out.stage_bytes.push_back(n);
  }
  for (int rank = 0; rank < out.layout.ranks_size(); ++rank) {
    const int64_t n = ArtifactStore::FileSize(absl::StrCat(dir, "/", ArtifactStore::ShareFileName(rank)));
    if (n < 0) return absl::InternalError(absl::StrCat("the preparation process wrote no data share for rank ", rank));
    out.share_bytes.push_back(n);
  }
  log::Info("prepared a submission in a child process in {} (its peak resident memory {} MiB)",
            absl::FormatDuration(absl::Now() - start), r.peak_rss_bytes >> 20);
  return out;
}

}  // namespace

absl::StatusOr<PreparedJob> PrepareJob(const JobSpec& submitted, const std::string& dir,
                                       const PrepareOptions& options) {
  JobSpec spec = submitted;
  PIPPY_RETURN_IF_ERROR(job::CheckSpec(&spec));
  if (ArtifactStore::FileSize(dir + "/model.pt") <= 0) return Bad("model", "empty: send the TorchScript file's bytes");
  if (options.preparer.empty()) return PrepareAndResolve(spec, dir, [](absl::string_view) {}, options);
  return PrepareInChild(spec, dir, options);
}

int RunPreparationChild(const std::string& dir, bool whole, const std::vector<std::string>& dataset_roots) {
  log::Init("prepare", log::Level::kOff);
  EnterChild(HeapCap(dir));
  JobSpec spec;
  absl::Status s = ReadMessage(dir + kSpecFile, &spec);
  std::string phase;
  auto announce = [&phase](absl::string_view p) {
    phase = std::string(p);
    AnnouncePhase(p);
  };
  PrepareOptions options;
  options.whole = whole;
  options.dataset_roots = dataset_roots;
  absl::StatusOr<PreparedJob> prepared = s.ok() ? PrepareAndResolve(spec, dir, announce, options) : s;
  if (prepared.ok()) s = WriteMessage(prepared->spec, dir + kPreparedSpecFile);
  if (prepared.ok() && s.ok()) s = WriteMessage(prepared->plan, dir + kPlanFile);
  if (prepared.ok() && s.ok()) s = WriteMessage(prepared->layout, dir + kLayoutFile);
  if (!prepared.ok()) s = prepared.status();
  if (!s.ok()) {
    std::string msg(s.message());
    if (OutOfMemory(s) && (phase == "load" || phase == "data")) {
      // Reading a file, not running the model: a pickle that announces more than it holds.
      absl::StrAppend(&msg, " (the file asks for far more memory than its size: it is corrupt or was not written by "
                            "PyTorch)");
    } else if (OutOfMemory(s) && !absl::StrContains(msg, "MiB: 2 GiB")) {
      absl::StrAppend(&msg, " (", HeapCapText(dir), ")");
    }
    ReportError(absl::Status(s.code(), msg));
    return 3;
  }
  ReportPeak();
  return 0;
}

}  // namespace pippy::coordinator
