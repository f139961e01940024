#include "pipeline/partition/cut_selection.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace pippy::partition {
namespace {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The nearest legal cuts below and above c that have a --split-at name.
std::string NearestLegalCuts(const ModelGraph& mg, int c) {
  std::vector<std::string> out;
  const auto& legal = mg.legal_cuts();
  auto it = std::lower_bound(legal.begin(), legal.end(), c);
  for (auto down = it; down != legal.begin();) {
    --down;
    std::string name = CutName(mg, *down);
    if (!name.empty()) {
      out.push_back(absl::StrCat("'", name, "'"));
      break;
    }
  }
  for (auto up = it; up != legal.end(); ++up) {
    if (*up == c) continue;
    std::string name = CutName(mg, *up);
    if (!name.empty()) {
      out.push_back(absl::StrCat("'", name, "'"));
      break;
    }
  }
  if (out.empty()) return "this model has no legal cut with a module name";
  return absl::StrCat("the nearest legal split points are ", absl::StrJoin(out, " and "));
}

}  // namespace

std::vector<std::string> NearestModulePaths(const ModelGraph& mg, const std::string& name,
                                            size_t limit) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& p : mg.module_paths()) scored.emplace_back(EditDistance(name, p), p);
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < limit; ++i) out.push_back(scored[i].second);
  return out;
}

std::string CutName(const ModelGraph& mg, int c) {
  if (c <= 0 || c >= mg.num_ops()) return "";
  const auto& spans = mg.module_spans();
  std::string best;
  // Highest-level module that starts exactly at op c.
  for (std::string path = mg.op_path(c); !path.empty();) {
    auto it = spans.find(path);
    if (it != spans.end() && it->second.first == c) best = path;
    auto dot = path.rfind('.');
    path = dot == std::string::npos ? "" : path.substr(0, dot);
  }
  if (!best.empty()) return best;
  for (std::string path = mg.op_path(c - 1); !path.empty();) {
    auto it = spans.find(path);
    if (it != spans.end() && it->second.second == c - 1) best = path + ":end";
    auto dot = path.rfind('.');
    path = dot == std::string::npos ? "" : path.substr(0, dot);
  }
  return best;
}

absl::StatusOr<std::vector<int>> CutsFromSplitAt(const ModelGraph& mg,
                                                 const std::vector<std::string>& split_at) {
  const auto& spans = mg.module_spans();
  std::vector<std::pair<int, std::string>> cuts;
  for (const std::string& spec : split_at) {
    std::string path = spec;
    bool after = false;
    int c = -1;
    if (absl::StartsWith(spec, "op:")) {
      // A plan's spelling of a cut no module path names: the op position itself.
      if (!absl::SimpleAtoi(spec.substr(3), &c)) {
        return absl::InvalidArgumentError(absl::StrCat("split point '", spec, "': op:N needs a number"));
      }
    } else {
      if (absl::EndsWith(path, ":end")) {
        path.resize(path.size() - 4);
        after = true;
      }
      auto it = spans.find(path);
      if (it == spans.end()) {
        bool exists = std::find(mg.module_paths().begin(), mg.module_paths().end(), path) !=
                      mg.module_paths().end();
        if (exists) {
          return absl::InvalidArgumentError(absl::StrCat(
              "split point '", spec, "': module '", path,
              "' runs no operations in forward(), so it marks no position; split at a module "
              "that forward() calls"));
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "split point '", spec, "': the model has no module '", path, "'; nearest names: ",
            absl::StrJoin(NearestModulePaths(mg, path), ", "),
            " (`pippyctl split MODEL --list-cuts` lists where the model can be cut)"));
      }
      c = after ? it->second.second + 1 : it->second.first;
    }
    if (c <= 0 || c >= mg.num_ops()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "split point '", spec, "' is at the ", c <= 0 ? "start" : "end",
          " of forward(), so one stage would be empty; ",
          after ? "drop ':end' or split at a later module" : "split at a later module or use ':end'"));
    }
    absl::Status legal = mg.ExplainCut(c);
    if (!legal.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot split at '", spec, "': ",
                                                     legal.message(), "; ", NearestLegalCuts(mg, c)));
    }
    cuts.emplace_back(c, spec);
  }
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 1; i < cuts.size(); ++i) {
    if (cuts[i].first == cuts[i - 1].first) {
      return absl::InvalidArgumentError(absl::StrCat("split points '", cuts[i - 1].second, "' and '",
                                                     cuts[i].second,
                                                     "' are the same position; drop one"));
    }
  }
  std::vector<int> out;
  for (const auto& c : cuts) out.push_back(c.first);
  return out;
}

absl::StatusOr<std::vector<int>> CutsFromMarkers(const ModelGraph& mg) {
  std::vector<int> out;
  for (size_t i = 0; i < mg.marker_cuts().size(); ++i) {
    int c = mg.marker_cuts()[i];
    const std::string& path = mg.marker_paths()[i];
    if (c <= 0 || c >= mg.num_ops()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PipeSplit marker '", path, "' is at the start or end of forward(); remove it"));
    }
    absl::Status legal = mg.ExplainCut(c);
    if (!legal.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("PipeSplit marker '", path, "' marks an illegal cut: ",
                                                     legal.message(), "; ", NearestLegalCuts(mg, c)));
    }
    if (!out.empty() && out.back() == c) {
      return absl::InvalidArgumentError(absl::StrCat("PipeSplit marker '", path,
                                                     "' marks the same position as the one before it"));
    }
    out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::vector<int>> BalancedCuts(const ModelGraph& mg, int num_stages,
                                              const std::vector<double>& op_costs,
                                              const std::vector<int>& candidates_in, double slack) {
  if (num_stages < 1) return absl::InvalidArgumentError("--stages must be at least 1");
  const std::vector<int>& candidates = candidates_in.empty() ? mg.legal_cuts() : candidates_in;
  if (num_stages - 1 > static_cast<int>(candidates.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot make ", num_stages, " stages: the model has only ", candidates.size(),
        " legal cut point(s) (at most ", candidates.size() + 1,
        " stages); use fewer stages (a cut is legal where only tensors cross it)"));
  }
  if (num_stages == 1) return std::vector<int>{};
  // Atoms: spans between consecutive candidate cuts.
  std::vector<int> bounds = {0};
  bounds.insert(bounds.end(), candidates.begin(), candidates.end());
  bounds.push_back(mg.num_ops());
  const int m = static_cast<int>(bounds.size()) - 1;
  std::vector<double> prefix(mg.num_ops() + 1, 0.0);
  for (int i = 0; i < mg.num_ops(); ++i) prefix[i + 1] = prefix[i] + std::max(0.0, op_costs[i]);
  // Atom boundary k (0..m) sits at op bounds[k]; cost of atoms [a, b) is P(b) - P(a).
  auto P = [&](int k) { return prefix[bounds[k]]; };
  const double total = P(m);

  // Minimal number of stages covering atoms [k, m) with every stage <= T (greedy).
  auto stages_needed = [&](double T, std::vector<int>* need) {
    need->assign(m + 1, 0);
    int j = m;
    for (int k = m - 1; k >= 0; --k) {
      // Farthest end e > k with P(e) - P(k) <= T; at least one atom.
      while (j > k + 1 && P(j) - P(k) > T) --j;
      if (j <= k) j = k + 1;
      (*need)[k] = 1 + (*need)[j];
      // Two-pointer validity: ends only move left as k decreases.
    }
  };
  // Exact optimum by bisection on T (the greedy test is monotone in T).
  double max_atom = 0;
  for (int k = 0; k < m; ++k) max_atom = std::max(max_atom, P(k + 1) - P(k));
  double lo = std::max(max_atom, total / num_stages), hi = std::max(total, lo);
  std::vector<int> need;
  for (int iter = 0; iter < 100 && hi - lo > 1e-9 * std::max(1.0, hi); ++iter) {
    double mid = 0.5 * (lo + hi);
    stages_needed(mid, &need);
    if (need[0] <= num_stages) hi = mid; else lo = mid;
  }
  const double T = hi * (1.0 + slack);
  stages_needed(T, &need);

  // Walk stages, choosing each end among the feasible ones: a major module boundary
  // close to an even share of the remaining cost.
  std::vector<int> cuts;
  int k = 0;
  for (int s = 0; s < num_stages - 1; ++s) {
    const int left = num_stages - s - 1;  // stages after this one
    const double target = P(k) + (total - P(k)) / (left + 1);
    int best = -1;
    double best_score = 0;
    for (int e = k + 1; e <= m - left; ++e) {
      if (P(e) - P(k) > T) break;
      if (need[e] > left) continue;
      double score = std::abs(P(e) - target) / std::max(hi, 1e-12) +
                     0.05 * mg.BoundaryDepth(bounds[e]);
      if (best < 0 || score < best_score) {
        best = e;
        best_score = score;
      }
    }
    if (best < 0) best = k + 1;  // cannot happen for a feasible T; keep progress
    cuts.push_back(bounds[best]);
    k = best;
  }
  return cuts;
}

}  // namespace pippy::partition
