#include "pipeline/tensor_parallel/tp_plan.h"

#include <fnmatch.h>

#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pippy::tp {
namespace {

constexpr char kExample[] = "layers.*.attn.q=colwise,layers.*.attn.o=rowwise";

bool ParseStyle(absl::string_view name, TpStyle* style) {
  if (name == "colwise") *style = TP_COLWISE;
  else if (name == "rowwise") *style = TP_ROWWISE;
  else if (name == "vocab") *style = TP_VOCAB;
  else return false;
  return true;
}

}  // namespace

std::string StyleName(TpStyle style) {
  switch (style) {
    case TP_COLWISE: return "colwise";
    case TP_ROWWISE: return "rowwise";
    case TP_VOCAB: return "vocab";
    default: return "unspecified";
  }
}

absl::StatusOr<TensorParallelSpec> ParsePlan(absl::string_view text, int size) {
  TensorParallelSpec spec;
  spec.set_size(size);
  std::set<std::string> seen;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    std::vector<absl::string_view> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("--tp-plan: '", entry, "' is not PATTERN=STYLE (e.g. ",
                                                     kExample, ")"));
    }
    const std::string pattern(absl::StripAsciiWhitespace(kv[0]));
    TpStyle style;
    if (!ParseStyle(absl::StripAsciiWhitespace(kv[1]), &style)) {
      return absl::InvalidArgumentError(absl::StrCat("--tp-plan: '", entry, "': unknown style '", kv[1],
                                                     "' (colwise, rowwise or vocab)"));
    }
    if (pattern.empty() || absl::StrContains(pattern, "..") || pattern.front() == '.' || pattern.back() == '.') {
      return absl::InvalidArgumentError(absl::StrCat("--tp-plan: '", entry,
                                                     "': the pattern must be a module path such as layers.*.attn.q"));
    }
    if (!seen.insert(pattern).second) {
      return absl::InvalidArgumentError(absl::StrCat("--tp-plan: '", pattern, "' is given twice; give it once"));
    }
    TpRule* rule = spec.add_rules();
    rule->set_pattern(pattern);
    rule->set_style(style);
  }
  if (absl::Status s = CheckSpec(spec); !s.ok()) return s;
  return spec;
}

std::string PlanText(const TensorParallelSpec& spec) {
  std::vector<std::string> parts;
  for (const TpRule& r : spec.rules()) parts.push_back(absl::StrCat(r.pattern(), "=", StyleName(r.style())));
  return absl::StrJoin(parts, ",");
}

bool Matches(absl::string_view pattern, absl::string_view path) {
  std::vector<std::string> p = absl::StrSplit(pattern, '.'), m = absl::StrSplit(path, '.');
  if (p.size() != m.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), m[i].c_str(), 0) != 0) return false;
  }
  return true;
}

absl::Status CheckSpec(const TensorParallelSpec& spec) {
  if (spec.size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tensor-parallel must be >= 1 (got ", spec.size(), ")"));
  }
  if (spec.size() <= 1) {
    if (spec.rules_size() > 0) {
      return absl::InvalidArgumentError("--tp-plan needs --tensor-parallel T with T >= 2 (the ranks per stage)");
    }
    return absl::OkStatus();
  }
  if (spec.rules_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tensor-parallel ", spec.size(),
                                                   " needs --tp-plan PATTERN=STYLE,... (e.g. ", kExample, ")"));
  }
  for (const TpRule& r : spec.rules()) {
    if (r.pattern().empty() || r.style() == TP_STYLE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("tensor_parallel.rules: '", r.pattern(),
                                                     "' needs a pattern and a style (colwise, rowwise, vocab)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pippy::tp
