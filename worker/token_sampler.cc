#include "worker/token_sampler.h"

#include <limits>

#include "ATen/CPUGeneratorImpl.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/torch_status.h"
#include "torch/torch.h"

namespace pippy::worker {

uint64_t DrawSeed(uint64_t seed, int64_t token_index) {
  // splitmix64 of the pair.
  uint64_t z = seed ^ (static_cast<uint64_t>(token_index) * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

int64_t SampleRowToken(at::Tensor l, const SampleRow& p) {
  if (p.temperature() <= 0) return l.argmax().item<int64_t>();
  l = l.to(at::kFloat) / static_cast<double>(p.temperature());
  const int64_t vocab = l.size(0);
  if (p.top_k() > 0 && p.top_k() < vocab) {
    const at::Tensor kth = std::get<0>(l.topk(p.top_k())).select(0, p.top_k() - 1);
    l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
  }
  at::Tensor probs = at::softmax(l, 0);
  if (p.top_p() > 0 && p.top_p() < 1) {
    // The smallest set of the likeliest tokens whose probabilities reach top_p.
    auto [sorted, order] = probs.sort(/*dim=*/0, /*descending=*/true);
    const at::Tensor before = sorted.cumsum(0) - sorted;
    sorted = sorted.masked_fill(before > static_cast<double>(p.top_p()), 0.0);
    probs = at::zeros_like(probs).scatter(0, order, sorted);
  }
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(DrawSeed(p.seed(), p.token_index()));
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> SampleTokens(const at::Tensor& logits,
                                                  const google::protobuf::RepeatedPtrField<SampleRow>& rows) {
  const int64_t B = rows.size();
  if (!logits.defined() || (logits.dim() != 3 && logits.dim() != 2) || logits.size(0) != B ||
      !at::isFloatingType(logits.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a generation model returns Float[B, L, vocab] logits; this one returned ",
        logits.defined() ? absl::StrCat(c10::toString(logits.scalar_type()), "[", absl::StrJoin(logits.sizes(), ", "), "]")
                         : "an undefined tensor",
        " for ", B, " row(s)"));
  }
  std::vector<int64_t> tokens(static_cast<size_t>(B), -1);
  absl::Status s = TorchCall("sampling", [&] {
    at::NoGradGuard no_grad;
    const at::Tensor last = logits.dim() == 3 ? logits.select(1, logits.size(1) - 1) : logits;  // [B, vocab]
    for (int64_t b = 0; b < B; ++b) {
      if (rows[static_cast<int>(b)].sample()) tokens[static_cast<size_t>(b)] = SampleRowToken(last[b], rows[static_cast<int>(b)]);
    }
  });
  if (!s.ok()) return s;
  return tokens;
}

}  // namespace pippy::worker
