// Fuzz target: the data file as the coordinator reads it (torch.save({"inputs": ...,
// "targets": ...}), SubmitJob's data), and the per-rank shares it cuts from it. LibTorch's
// unpickler runs in a child first (fuzz/child.h), as in the coordinator's model check:
// it makes room for whatever length a pickle announces. What a child gets through is read
// here, for a model of one and of two arguments, and must be refused with an error or
// give batches, targets and shares that read back to the same samples.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/log.h"
#include "fuzz/child.h"
#include "pipeline/stage/data_source.h"

namespace {

const std::vector<std::vector<std::string>> kArguments = {{"x"}, {"x", "mask"}};

void Exercise(const pippy::stage::DataSource& data, const std::vector<std::string>& names) {
  const int64_t n = data.num_samples();
  if (n <= 0) return;
  const int64_t batch = std::min<int64_t>(n, 4);
  (void)data.Inputs(1, batch);
  if (data.has_targets()) (void)data.Target(1, batch);
  std::vector<int> all;
  for (size_t i = 0; i < names.size(); ++i) all.push_back(static_cast<int>(i));
  auto share = data.ShareBytes(all, data.has_targets());
  if (!share.ok()) return;
  auto back = pippy::stage::DataSource::FromShareBytes(*share, names);
  if (!back.ok() || back->num_samples() != n) {  // a share reads back
    fprintf(stderr, "data_fuzz: a share of %lld samples read back as %s\n", static_cast<long long>(n),
            back.ok() ? std::to_string(back->num_samples()).c_str() : back.status().ToString().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pippy::log::Init("data_fuzz", pippy::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto in_child = pippy::fuzz::InChild([&] {
    for (const auto& names : kArguments) {
      if (pippy::stage::DataSource::FromBytes(bytes, names).ok()) return 0;
    }
    return 2;
  });
  if (in_child != pippy::fuzz::Child::kOk) return 0;
  for (const auto& names : kArguments) {
    auto source = pippy::stage::DataSource::FromBytes(bytes, names);
    if (source.ok()) Exercise(*source, names);
  }
  return 0;
}
