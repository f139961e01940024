#include "pipeline/stage/synthetic_data.h"

#include "ATen/ATen.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::stage {
namespace {

absl::StatusOr<at::Tensor> MakeTensor(const std::string& text, at::Generator& gen) {
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat("data.synthetic: '", text,
                                                   "' is not DTYPE[d0,d1,...] (float32, float64, int64) with an "
                                                   "optional @N range for integers"));
  };
  auto lb = text.find('['), rb = text.find(']');
  if (lb == std::string::npos || rb == std::string::npos || rb < lb) return bad();
  std::string dtype = text.substr(0, lb);
  std::vector<int64_t> shape;
  for (absl::string_view d : absl::StrSplit(text.substr(lb + 1, rb - lb - 1), ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(d, &v) || v <= 0) return bad();
    shape.push_back(v);
  }
  int64_t high = 2;
  if (rb + 1 < text.size()) {
    if (text[rb + 1] != '@' || !absl::SimpleAtoi(text.substr(rb + 2), &high) || high <= 0) return bad();
  }
  if (dtype == "float32") return at::randn(shape, gen, at::kFloat);
  if (dtype == "float64") return at::randn(shape, gen, at::kDouble);
  if (dtype == "int64") return at::randint(0, high, shape, gen, at::kLong);
  return bad();
}

}  // namespace

absl::StatusOr<std::string> MakeSyntheticData(const std::string& spec) {
  std::vector<std::string> inputs;
  std::string targets;
  uint64_t seed = 0;
  for (absl::string_view part : absl::StrSplit(spec, ';', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    if (kv.first == "inputs") {
      inputs = absl::StrSplit(kv.second, absl::ByAnyChar(","), absl::SkipEmpty());
      // Re-join shapes split on their inner commas: "float32[8", "8]" -> "float32[8,8]".
      std::vector<std::string> joined;
      for (const std::string& piece : inputs) {
        if (!joined.empty() && joined.back().find(']') == std::string::npos) joined.back() += "," + piece;
        else joined.push_back(piece);
      }
      inputs = joined;
    } else if (kv.first == "targets") {
      targets = kv.second;
    } else if (kv.first == "seed") {
      if (!absl::SimpleAtoi(kv.second, &seed)) return absl::InvalidArgumentError("data.synthetic: seed must be an integer");
    } else {
      return absl::InvalidArgumentError(absl::StrCat("data.synthetic: unknown part '", kv.first,
                                                     "' (use inputs=..., targets=..., seed=N)"));
    }
  }
  if (inputs.empty()) return absl::InvalidArgumentError("data.synthetic: needs inputs=DTYPE[shape]");
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::vector<c10::IValue> in;
  for (const std::string& t : inputs) {
    auto tensor = MakeTensor(t, gen);
    if (!tensor.ok()) return tensor.status();
    in.push_back(*tensor);
  }
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("inputs", in.size() == 1 ? in[0] : c10::IValue(c10::ivalue::Tuple::create(in)));
  if (!targets.empty()) {
    auto tensor = MakeTensor(targets, gen);
    if (!tensor.ok()) return tensor.status();
    dict.insert("targets", *tensor);
  }
  std::vector<char> bytes = torch::jit::pickle_save(dict);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace pippy::stage
