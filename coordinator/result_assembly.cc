#include "coordinator/result_assembly.h"

#include <csignal>
#include <cstring>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/child_process.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/merge.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::coordinator {
namespace {

// Paths as the files are named in a job's folder (artifact_store.h).
std::string ModelIn(const std::string& dir) { return dir + "/model.pt"; }
std::string ResultIn(const std::string& dir, int stage) { return absl::StrCat(dir, "/result_", stage, ".pt"); }
std::string AssembledIn(const std::string& dir) { return dir + "/assembled.pt"; }
std::string PlanIn(const std::string& dir) { return dir + "/tp_plan.pb"; }

// Tensor parallelism: each stage's shards gathered into one stage file with the whole
// tensors, DIR/gathered_<s>.pt (one stage's shards in memory at a time).
absl::Status GatherShardsIn(const std::string& dir, const PipelinePlan& plan, std::map<int, std::string>* results) {
  const int T = plan.tensor_parallel().size();
  for (const StagePlan& sp : plan.stages()) {
    const int s = sp.index();
    std::vector<torch::jit::Module> shards;
    for (int t = 0; t < T; ++t) {
      PIPPY_ASSIGN_OR_RETURN(torch::jit::Module m, torchio::LoadModel(ResultIn(dir, s * T + t)));
      shards.push_back(m);
    }
    PIPPY_ASSIGN_OR_RETURN(auto whole, tp::GatherShards(sp, shards));
    const std::string path = absl::StrCat(dir, "/gathered_", s, ".pt");
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("writing stage ", s, " gathered from its shards"), [&] {
      torch::jit::Module m = shards[0];
      for (const auto& [name, tensor] : whole) {
        torch::jit::Module owner = m;
        std::string leaf = name;
        for (auto dot = leaf.find('.'); dot != std::string::npos; dot = leaf.find('.')) {
          owner = owner.attr(leaf.substr(0, dot)).toModule();
          leaf = leaf.substr(dot + 1);
        }
        owner.setattr(leaf, tensor);
      }
      m.save(path);
    }, absl::StatusCode::kInternal));
    (*results)[s] = path;
  }
  return absl::OkStatus();
}

absl::Status MergeHere(const std::string& dir, int stages) {
  std::map<int, std::string> results;
  PipelinePlan plan;
  if (ArtifactStore::FileSize(PlanIn(dir)) > 0) {
    std::ifstream in(PlanIn(dir), std::ios::binary);
    if (!plan.ParseFromIstream(&in)) return absl::DataLossError(absl::StrCat("cannot read ", PlanIn(dir)));
  }
  if (plan.tensor_parallel().size() > 1) {
    PIPPY_RETURN_IF_ERROR(GatherShardsIn(dir, plan, &results));
  } else {
    for (int st = 0; st < stages; ++st) results[st] = ResultIn(dir, st);
  }
  // Record by record where the model's tensors each own their storage; else whole.
  absl::Status merged = partition::MergeStagesByRecords(ModelIn(dir), results, AssembledIn(dir));
  if (!absl::IsUnimplemented(merged)) return merged;
  return partition::MergeStagesIntoModel(ModelIn(dir), results, AssembledIn(dir));
}

absl::Status MergeInChild(const std::string& dir, int stages, const AssembleOptions& options) {
  using Ending = ChildResult::Ending;
  ChildSpec spec;
  spec.argv = {options.merger, kMergeFlag, dir, absl::StrCat(stages)};
  spec.timeout = options.timeout;
  spec.cancelled = options.cancelled;
  const ChildResult r = RunChild(spec);
  if (r.ending == Ending::kExited && r.exit_code == 0) {
    log::Info("merged the trained stages in a child process (its peak resident memory {} MiB)", r.peak_rss_bytes >> 20);
  }
  if (std::optional<absl::Status> plain = PlainEnding(r, "merging the trained stages")) return *plain;
  switch (r.ending) {
    case Ending::kTimedOut:
    case Ending::kPhaseTimedOut:
      return absl::InvalidArgumentError(absl::StrCat("merging the trained stages did not finish within ",
                                                     absl::FormatDuration(r.limit), " (--prepare-timeout-s)"));
    case Ending::kSignalled:
      return absl::InvalidArgumentError(absl::StrCat("LibTorch crashed (signal ", r.signal, ", ", strsignal(r.signal),
                                                     ") merging the trained stages: a stage file a worker sent is "
                                                     "corrupt"));
    default:
      return absl::InternalError("unreachable: PlainEnding words the other endings");
  }
}

}  // namespace

absl::StatusOr<std::string> AssembleResult(ArtifactStore& files, const std::string& job_id, bool inference,
                                           int stages, const AssembleOptions& options) {
  if (!files.ResultsComplete(job_id, inference ? -1 : stages)) {
    return absl::DataLossError(inference ? "the last rank finished without sending all of its outputs; submit the "
                                           "job again"
                                         : "a rank finished without sending all of its trained stages; submit the "
                                           "job again");
  }
  if (inference) return files.OutputsPath(job_id);
  return MergeStagesIn(files.JobDir(job_id), stages, options);
}

absl::StatusOr<std::string> MergeStagesIn(const std::string& dir, int stages, const AssembleOptions& options) {
  if (options.plan.tensor_parallel().size() > 1) {
    std::ofstream out(PlanIn(dir), std::ios::binary | std::ios::trunc);
    if (!options.plan.SerializeToOstream(&out) || !out.flush()) {
      return absl::UnavailableError(absl::StrCat("cannot write ", PlanIn(dir)));
    }
  }
  absl::Status merged = options.merger.empty() ? MergeHere(dir, stages) : MergeInChild(dir, stages, options);
  if (!merged.ok()) return merged;
  return AssembledIn(dir);
}

int RunMergeChild(const std::string& dir, int stages) {
  log::Init("merge", log::Level::kOff);
  uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(0, ArtifactStore::FileSize(ModelIn(dir))));
  for (int st = 0; st < stages; ++st) {
    bytes += static_cast<uint64_t>(std::max<int64_t>(0, ArtifactStore::FileSize(ResultIn(dir, st))));
  }
  EnterChild(ChildHeapCap(bytes));
  AnnouncePhase("merge");
  absl::Status s = stages > 0 ? MergeHere(dir, stages) : absl::InvalidArgumentError("merge: no stages");
  if (!s.ok()) {
    ReportError(s);
    return 3;
  }
  ReportPeak();
  return 0;
}

}  // namespace pippy::coordinator
