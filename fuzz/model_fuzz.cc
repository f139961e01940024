// Fuzz target: the model loader and the partitioner on mutated TorchScript archives
// (what SubmitJob and pippyctl split receive as model.pt). As the coordinator does
// (coordinator/job_preparation.h), each input is first loaded in a child process: LibTorch's
// deserializer and TorchScript compiler crash on some corrupt archives (a stack overflow
// in the parser on deep nesting, a bad pointer in the type parser), which is LibTorch's
// to fix and the child's to absorb. What a child survives is loaded here, where any bytes
// must be refused with an error or load to a module that the partitioner lists cuts for
// and splits in two (or refuses to, with an error).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "common/log.h"
#include "fuzz/child.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pippy::log::Init("model_fuzz", pippy::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pippy::partition;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto in_child = pippy::fuzz::InChild([&] {
    auto model = pippy::torchio::LoadModelFromBytes(bytes, "fuzz.pt");
    if (!model.ok()) return 2;
    (void)ListLegalCuts(*model);
    return 0;
  });
  if (in_child != pippy::fuzz::Child::kOk) return 0;
  auto model = pippy::torchio::LoadModelFromBytes(bytes, "fuzz.pt");
  if (!model.ok()) return 0;
  (void)ListLegalCuts(*model);
  SplitOptions options;
  options.num_stages = 2;
  options.share_tensors = true;
  (void)SplitModel(*model, options);
  return 0;
}
