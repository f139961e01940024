// Fuzz target: the partitioner on a valid model with mutated split specs (--stages,
// --split-at, --balance, as SubmitJob passes them). The model is loaded once from
// $PIPPY_FUZZ_MODEL (default: the test zoo's gpt.pt), its example input from the
// matching .input.pt. Every spec is refused with INVALID_ARGUMENT or splits.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "common/log.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "proto/job.pb.h"

namespace {

struct Base {
  torch::jit::Module model;
  std::vector<c10::IValue> inputs;
  std::vector<std::string> cut_names;
};
Base* base = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pippy::log::Init("split_fuzz", pippy::log::Level::kOff);
  const char* env = std::getenv("PIPPY_FUZZ_MODEL");
  const std::string path = env != nullptr ? env : "examples/models/zoo/gpt.pt";
  auto model = pippy::torchio::LoadModel(path);
  if (!model.ok()) {
    fprintf(stderr, "split_fuzz: %s (set PIPPY_FUZZ_MODEL to a TorchScript model)\n", model.status().ToString().c_str());
    std::exit(1);
  }
  base = new Base{*model, {}, {}};
  const std::string input = path.substr(0, path.size() - 3) + ".input.pt";
  auto inputs = pippy::torchio::LoadExampleInputs(input, *model);
  if (inputs.ok()) base->inputs = *inputs;
  auto cuts = pippy::partition::ListLegalCuts(*model);
  if (cuts.ok()) {
    for (const auto& c : *cuts) {
      if (!c.name.empty()) base->cut_names.push_back(c.name);
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  pippy::partition::SplitOptions options;
  options.share_tensors = true;
  options.num_stages = in.ConsumeIntegralInRange<int>(-2, 40);
  options.balance = static_cast<pippy::Balance>(in.ConsumeIntegralInRange<int>(0, 4));
  if (in.ConsumeBool()) options.example_inputs = base->inputs;
  const int points = in.ConsumeIntegralInRange<int>(0, 6);
  for (int i = 0; i < points && in.remaining_bytes() > 0; ++i) {
    if (!base->cut_names.empty() && in.ConsumeBool()) {
      // A legal cut by name, sometimes with text after it (":end", a typo, ...).
      std::string name = base->cut_names[in.ConsumeIntegralInRange<size_t>(0, base->cut_names.size() - 1)];
      if (in.ConsumeBool()) name += in.ConsumeRandomLengthString(16);
      options.split_at.push_back(name);
    } else {
      options.split_at.push_back(in.ConsumeRandomLengthString(32));
    }
  }
  auto pipe = pippy::partition::SplitModel(base->model, options);
  if (pipe.ok() && pipe->stages.size() != static_cast<size_t>(pipe->plan.stages_size())) std::abort();
  return 0;
}
