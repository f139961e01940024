// Fuzz target: a serving request's input as the coordinator reads it (Infer's bytes,
// in its own process: torchio::PickleLoadUntrusted, then forward()'s arguments for
// a model of one and of two arguments). Unlike data_fuzz there is no child: whatever
// the bytes announce, this must fail with an error, never crash, allocate beyond
// libFuzzer's -malloc_limit_mb (fuzz/flags.sh) or recurse without bound.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/log.h"
#include "pipeline/torchio/model_io.h"

namespace {
const std::vector<std::vector<std::string>> kArguments = {{"x"}, {"x", "mask"}};
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pippy::log::Init("request_fuzz", pippy::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto value = pippy::torchio::PickleLoadUntrusted(bytes, "input");
  if (!value.ok()) return 0;
  for (const auto& names : kArguments) {
    auto args = pippy::torchio::ToForwardArguments(*value, names, "input");
    if (!args.ok()) continue;
    // As the coordinator does (ServingQueue::Submit): tensors it accepts are read whole.
    for (const c10::IValue& a : *args) {
      if (!a.isTensor() || !pippy::torchio::CheckRowTensor(a.toTensor(), "input").ok()) continue;
      try {  // inside TorchCall there, which turns LibTorch's exceptions into errors
        if (a.toTensor().numel() > 0) (void)a.toTensor().contiguous().sum();  // reads every element
      } catch (const c10::Error&) {
      }
    }
  }
  return 0;
}
