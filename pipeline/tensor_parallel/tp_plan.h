// A tensor-parallel plan as users write it (pippyctl --tp-plan, the Python client):
// "PATTERN=STYLE,PATTERN=STYLE,...", STYLE one of colwise, rowwise, vocab, e.g.
//   layers.*.attn.q=colwise,layers.*.attn.k=colwise,layers.*.attn.v=colwise,
//   layers.*.attn.o=rowwise,layers.*.mlp.up=colwise,layers.*.mlp.down=rowwise,tok_emb=vocab
// No LibTorch.
#ifndef PIPPY_PIPELINE_TENSOR_PARALLEL_TP_PLAN_H_
#define PIPPY_PIPELINE_TENSOR_PARALLEL_TP_PLAN_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/job.pb.h"

namespace pippy::tp {

// The spec for `size` ranks per stage and the plan `text`.
// Errors: INVALID_ARGUMENT naming the entry that does not parse (no '=', an unknown
// style, an empty or malformed pattern, a pattern given twice) and what to write.
absl::StatusOr<TensorParallelSpec> ParsePlan(absl::string_view text, int size);

// The plan as ParsePlan reads it back.
std::string PlanText(const TensorParallelSpec& spec);

// "colwise", "rowwise", "vocab".
std::string StyleName(TpStyle style);

// Whether module path `path` ("layers.3.attn.q") matches `pattern` atom by atom: the
// same number of atoms, each matching as fnmatch(3) does ('*', '?', [...]).
bool Matches(absl::string_view pattern, absl::string_view path);

// A checked spec: size >= 2 needs rules; every rule has a pattern and a style.
// Errors: INVALID_ARGUMENT saying what is missing.
absl::Status CheckSpec(const TensorParallelSpec& spec);

}  // namespace pippy::tp

#endif  // PIPPY_PIPELINE_TENSOR_PARALLEL_TP_PLAN_H_
