// A dataset the ranks read themselves (docs/data.md), in one of two formats:
//
//   token streams: flat files of token ids ("*.bin": uint16 or uint32, little-endian,
//     no header, as nanoGPT and Megatron write them); the shards in order form one
//     stream of T tokens; with seq_len L there are (T - 1) / L samples, sample i the
//     window of L + 1 tokens starting at token i x L (consecutive windows share one
//     token), forward()'s one argument its first L (int64) and the targets its last L.
//   tensor shards: torch.save({"inputs": ..., "targets": ...}) files ("*.pt"), each a
//     slice of rows, "inputs" as a data file's (a tensor, a tuple, or a dict by
//     forward()'s argument names); every shard's columns alike (dtype, row shape).
//
// The path is a folder (its "*.bin" or "*.pt" files in name order; both kinds, or
// neither, is refused) or a manifest file naming one shard per line (relative to the
// manifest's folder or absolute; blank lines and lines starting with '#' skipped).
// Every shard must lie under one of the allowed roots (the daemons' --dataset-root),
// symbolic links resolved: a job reads only what its operator opened to jobs.
//
// Index (the coordinator's preparation) lists the shards and checks them; Open (a rank)
// takes that index and reads only the rows its steps need, with pread, one sample at a
// time: memory holds one batch, whatever the dataset's size. Which samples a step
// reads is the Sampler's (sampler.h).
//
// Thread safety: none; the rank's thread reads.
#ifndef PIPPY_PIPELINE_STAGE_DATASET_H_
#define PIPPY_PIPELINE_STAGE_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/stage/batch_source.h"
#include "pipeline/stage/sampler.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::stage {

// Whether `path` (resolved) lies under one of `roots`. Errors: PERMISSION_DENIED
// naming the path and the roots ("none" when empty: datasets are off), NOT_FOUND when
// it does not exist.
absl::Status CheckUnderRoots(const std::string& path, const std::vector<std::string>& roots);

// Lists and checks the dataset `spec` names for a job of `batch` samples per step that
// seeds with `seed`; `argument_names` are forward()'s. Reads the zip directory and
// pickle of each tensor shard, the size of each token shard, no samples.
// Errors: INVALID_ARGUMENT starting "dataset:" and naming the file: an empty folder,
// a folder of neither or both kinds, a token shard whose length is not a multiple of
// the token width, a tensor shard that is not a torch.save dict of "inputs" (and
// "targets") or whose columns differ from the first shard's, fewer samples than one
// batch, a token stream for a model of more than one argument; PERMISSION_DENIED /
// NOT_FOUND as CheckUnderRoots.
absl::StatusOr<DatasetLayout> IndexDataset(const DatasetSpec& spec, const std::vector<std::string>& argument_names,
                                           int64_t batch, const std::vector<std::string>& roots);

class Dataset : public BatchSource {
 public:
  // A rank's reader of the dataset `layout` indexed: forward()'s arguments (named
  // `argument_names`) at `input_indices` and, with `with_targets`, the targets; steps
  // of `batch` samples ordered by a Sampler seeded with `seed`.
  // Errors: FAILED_PRECONDITION naming a shard that is gone or changed size since it
  // was indexed; PERMISSION_DENIED as CheckUnderRoots; INVALID_ARGUMENT for a tensor
  // shard that no longer reads as indexed.
  static absl::StatusOr<std::unique_ptr<Dataset>> Open(const DatasetSpec& spec, const DatasetLayout& layout,
                                                       const std::vector<std::string>& argument_names,
                                                       const std::vector<int>& input_indices, bool with_targets,
                                                       int64_t batch, uint64_t seed,
                                                       const std::vector<std::string>& roots);
  ~Dataset() override;

  // The step's batch (sampler.h's samples, in its order). Errors: DATA_LOSS naming the
  // shard and offset of a short read; INVALID_ARGUMENT naming the shard and token
  // offset of a token id at or above the layout's token_limit.
  absl::StatusOr<Batch> Read(int64_t step, int64_t batch, int replica, int replicas) override;

  Sampler& sampler() { return sampler_; }
  // Bytes read from the shards so far (for benchmarks).
  int64_t bytes_read() const;

  class Format;  // token streams or tensor shards (dataset.cc)

 private:
  Dataset(Sampler sampler, std::unique_ptr<Format> format);
  // Asks the kernel for the rows of the steps after `step` (posix_fadvise WILLNEED),
  // kPrefetchBytes ahead, so that the disk reads them while this step computes; not
  // once kWarmReads reads in a row found their rows in the page cache.
  void Prefetch(int64_t step, int replica, int replicas);

  static constexpr int64_t kPrefetchBytes = 8 << 20;
  static constexpr int64_t kWarmReads = 256;

  Sampler sampler_;
  std::unique_ptr<Format> format_;
  int64_t prefetched_from_ = -1;  // the last step read
  int64_t prefetched_to_ = -1;    // the last step whose rows were asked for
  int64_t step_bytes_ = 0;        // the bytes of a step's rows
  int64_t reads_since_miss_ = 0;  // reads in a row that found their rows in the page cache
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_DATASET_H_
