#include "pipeline/schedule/simulator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pippy::schedule {
namespace {

using Key = std::tuple<int, int, int>;  // (type, stage, microbatch)

Key K(ActionType t, int stage, int mb) { return {static_cast<int>(t), stage, mb}; }

bool Remote(const Schedule& sc, int rank, int stage) { return sc.stage_to_rank[stage] != rank; }

absl::Status Invalid(const Schedule& sc, const std::string& what, const std::vector<int>& marks = {}) {
  return absl::InvalidArgumentError(absl::StrCat("schedule '", sc.name, "' is invalid: ", what, "\n",
                                                 RenderSteps(sc, marks)));
}

}  // namespace

absl::StatusOr<Costs> ParseCosts(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  Costs c;
  double v[3];
  if (parts.size() != 3 || !absl::SimpleAtod(parts[0], &v[0]) || !absl::SimpleAtod(parts[1], &v[1]) ||
      !absl::SimpleAtod(parts[2], &v[2]) || v[0] <= 0 || v[1] <= 0 || v[2] <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--costs '", text, "': expected three positive numbers F,B,W (forward, backward for inputs, "
        "backward for weights), e.g. 1,1,1"));
  }
  c.forward = v[0];
  c.backward_input = v[1];
  c.backward_weight = v[2];
  return c;
}

std::string RenderSteps(const Schedule& sc, const std::vector<int>& marks) {
  size_t steps = 0, width = 4;
  for (const auto& l : sc.ranks) {
    steps = std::max(steps, l.size());
    for (const Action& a : l) width = std::max(width, a.ToString().size() + 2);
  }
  std::string out = absl::StrFormat("%-8s", "step");
  for (size_t i = 0; i < steps; ++i) absl::StrAppend(&out, absl::StrFormat("%-*d", static_cast<int>(width) + 1, i));
  out += "\n";
  for (int r = 0; r < sc.num_ranks; ++r) {
    std::string row = absl::StrFormat("rank %-3d", r);
    for (size_t i = 0; i < sc.ranks[r].size(); ++i) {
      std::string cell = sc.ranks[r][i].ToString();
      if (r < static_cast<int>(marks.size()) && marks[r] == static_cast<int>(i)) cell = "*" + cell + "*";
      absl::StrAppend(&row, absl::StrFormat("%-*s", static_cast<int>(width) + 1, cell));
    }
    if (r < static_cast<int>(marks.size()) && marks[r] == static_cast<int>(sc.ranks[r].size())) row += "(done)";
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  return out;
}

namespace {

// Validate's checks, of every rank (`only` < 0) or of rank `only` alone: the action
// lists of the other ranks are then not looked at, and only the stages `only` holds.
absl::Status CheckActions(const Schedule& sc, int only) {
  if (static_cast<int>(sc.ranks.size()) != sc.num_ranks ||
      static_cast<int>(sc.stage_to_rank.size()) != sc.num_stages ||
      sc.graph.num_stages() != sc.num_stages) {
    return absl::InvalidArgumentError("schedule shape is inconsistent (ranks, stages, graph)");
  }
  std::map<Key, int> count;
  for (int r = 0; r < sc.num_ranks; ++r) {
    if (only >= 0 && r != only) continue;
    for (size_t i = 0; i < sc.ranks[r].size(); ++i) {
      const Action& a = sc.ranks[r][i];
      std::vector<int> marks(sc.num_ranks, -1);
      marks[r] = static_cast<int>(i);
      if (a.stage < 0 || a.stage >= sc.num_stages || a.microbatch < 0 || a.microbatch >= sc.num_microbatches) {
        return Invalid(sc, absl::StrCat("rank ", r, " step ", i, ": ", a.ToString(), " is out of range (",
                                        sc.num_stages, " stages, ", sc.num_microbatches, " micro-batches)"),
                       marks);
      }
      if (sc.stage_to_rank[a.stage] != r) {
        return Invalid(sc, absl::StrCat("rank ", r, " step ", i, ": ", a.ToString(), " belongs to stage ",
                                        a.stage, ", which lives on rank ", sc.stage_to_rank[a.stage]),
                       marks);
      }
      if (sc.forward_only && a.type != ActionType::kForward && a.type != ActionType::kSendForward &&
          a.type != ActionType::kRecvForward) {
        return Invalid(sc, absl::StrCat("rank ", r, " step ", i, ": ", a.ToString(), " in a forward-only schedule"),
                       marks);
      }
      if (++count[K(a.type, a.stage, a.microbatch)] > 1) {
        return Invalid(sc, absl::StrCat("rank ", r, " step ", i, ": ", a.ToString(), " appears twice"), marks);
      }
    }
  }
  for (int s = 0; s < sc.num_stages; ++s) {
    if (only >= 0 && sc.stage_to_rank[s] != only) continue;
    for (int mb = 0; mb < sc.num_microbatches; ++mb) {
      auto has = [&](ActionType t) { return count[K(t, s, mb)] > 0; };
      std::string where_s = absl::StrCat("stage ", s, " micro-batch ", mb, " (rank ", sc.stage_to_rank[s], ")");
      if (!has(ActionType::kForward)) return Invalid(sc, absl::StrCat(where_s, " is never forwarded (no ", s, "F", mb, ")"));
      if (sc.forward_only) continue;
      bool full = has(ActionType::kBackward), in = has(ActionType::kBackwardInput),
           w = has(ActionType::kBackwardWeight);
      if (full && (in || w)) return Invalid(sc, absl::StrCat(where_s, " has both B and I/W"));
      if (!full && !(in && w)) {
        return Invalid(sc, absl::StrCat(where_s, " is never fully backpropagated (needs ", s, "B", mb, ", or ", s,
                                        "I", mb, " and ", s, "W", mb, ")"));
      }
      // Communication must be there where data crosses ranks, in both directions.
      const int r = sc.stage_to_rank[s];
      bool remote_consumer = false, remote_producer = false;
      for (int c : sc.graph.consumers[s]) remote_consumer |= Remote(sc, r, c);
      for (int p : sc.graph.Producers(s)) remote_producer |= Remote(sc, r, p);
      if (remote_producer && !has(ActionType::kRecvForward)) {
        return Invalid(sc, absl::StrCat(where_s, " takes inputs from another rank but there is no RECV_F (",
                                        s, "RECV_F", mb, ")"));
      }
      if (remote_consumer && !has(ActionType::kSendForward)) {
        return Invalid(sc, absl::StrCat(where_s, " feeds another rank but there is no ", s, "SEND_F", mb));
      }
      if (remote_consumer && !has(ActionType::kRecvBackward)) {
        return Invalid(sc, absl::StrCat(where_s, " needs gradients from another rank but there is no ", s,
                                        "RECV_B", mb));
      }
      if (remote_producer && !has(ActionType::kSendBackward)) {
        return Invalid(sc, absl::StrCat(where_s, " owes gradients to another rank but there is no ", s, "SEND_B",
                                        mb));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Validate(const Schedule& sc) { return CheckActions(sc, -1); }

absl::Status ValidateRank(const Schedule& sc, int rank) {
  if (rank < 0 || rank >= sc.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is not one of the schedule's ", sc.num_ranks));
  }
  return CheckActions(sc, rank);
}

absl::StatusOr<SimulationResult> Simulate(const Schedule& sc, const Costs& costs) {
  absl::Status valid = Validate(sc);
  if (!valid.ok()) return valid;
  const int R = sc.num_ranks;
  std::map<Key, double> done;  // finish time of every executed action
  std::vector<size_t> pc(R, 0);
  std::vector<double> t(R, 0.0);
  SimulationResult res;
  res.busy.assign(R, 0.0);
  res.timeline.assign(R, {});
  res.peak_live_per_stage.assign(sc.num_stages, 0);
  res.peak_live_per_rank.assign(R, 0);
  std::vector<int> live_stage(sc.num_stages, 0), live_rank(R, 0);
  auto finished = [&](ActionType type, int s, int mb, double* when) {
    auto it = done.find(K(type, s, mb));
    if (it == done.end()) return false;
    *when = std::max(*when, it->second);
    return true;
  };
  auto backprop_done = [&](int s, int mb, double* when) {
    return finished(ActionType::kBackward, s, mb, when) || finished(ActionType::kBackwardInput, s, mb, when);
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      while (pc[r] < sc.ranks[r].size()) {
        const Action& a = sc.ranks[r][pc[r]];
        double ready = t[r];
        bool ok = true;
        double cost = 0;
        switch (a.type) {
          case ActionType::kSendForward:
          case ActionType::kSendBackward:
            break;
          case ActionType::kRecvForward:
            for (int p : sc.graph.Producers(a.stage)) {
              if (Remote(sc, r, p)) ok &= finished(ActionType::kSendForward, p, a.microbatch, &ready);
            }
            ready += costs.RecvForward(a.stage);
            break;
          case ActionType::kRecvBackward:
            for (int c : sc.graph.consumers[a.stage]) {
              if (Remote(sc, r, c)) ok &= finished(ActionType::kSendBackward, c, a.microbatch, &ready);
            }
            ready += costs.RecvBackward(a.stage);
            break;
          case ActionType::kForward:
            cost = costs.Forward(a.stage);
            for (int p : sc.graph.Producers(a.stage)) {
              ok &= Remote(sc, r, p) ? finished(ActionType::kRecvForward, a.stage, a.microbatch, &ready)
                                     : finished(ActionType::kForward, p, a.microbatch, &ready);
            }
            break;
          case ActionType::kBackward:
          case ActionType::kBackwardInput:
            cost = a.type == ActionType::kBackward ? costs.BackwardInput(a.stage) + costs.BackwardWeight(a.stage)
                                                   : costs.BackwardInput(a.stage);
            ok &= finished(ActionType::kForward, a.stage, a.microbatch, &ready);
            for (int c : sc.graph.consumers[a.stage]) {
              ok &= Remote(sc, r, c) ? finished(ActionType::kRecvBackward, a.stage, a.microbatch, &ready)
                                     : backprop_done(c, a.microbatch, &ready);
            }
            break;
          case ActionType::kBackwardWeight:
            cost = costs.BackwardWeight(a.stage);
            ok &= finished(ActionType::kBackwardInput, a.stage, a.microbatch, &ready);
            break;
        }
        if (!ok) break;
        // A compute action whose local inputs are missing can never run: report it
        // (a send that precedes its compute is caught the same way).
        double end = ready + cost;
        t[r] = end;
        done[K(a.type, a.stage, a.microbatch)] = end;
        res.timeline[r].push_back({a, ready, end});
        if (a.IsCompute()) res.busy[r] += cost;
        if (a.type == ActionType::kForward && !sc.forward_only) {
          ++live_stage[a.stage];
          ++live_rank[r];
        } else if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight) {
          --live_stage[a.stage];
          --live_rank[r];
        }
        if (a.type == ActionType::kForward && sc.forward_only) {
          res.peak_live_per_stage[a.stage] = std::max(res.peak_live_per_stage[a.stage], 1);
          res.peak_live_per_rank[r] = std::max(res.peak_live_per_rank[r], 1);
        }
        res.peak_live_per_stage[a.stage] = std::max(res.peak_live_per_stage[a.stage], live_stage[a.stage]);
        res.peak_live_per_rank[r] = std::max(res.peak_live_per_rank[r], live_rank[r]);
        ++pc[r];
        progress = true;
      }
    }
  }
  bool all_done = true;
  for (int r = 0; r < R; ++r) all_done &= pc[r] == sc.ranks[r].size();
  if (!all_done) {
    std::vector<int> marks(R);
    std::vector<std::string> stuck;
    for (int r = 0; r < R; ++r) {
      marks[r] = static_cast<int>(pc[r]);
      if (pc[r] < sc.ranks[r].size()) {
        stuck.push_back(absl::StrCat("rank ", r, " at step ", pc[r], " (", sc.ranks[r][pc[r]].ToString(), ")"));
      }
    }
    return Invalid(sc, absl::StrCat("it deadlocks: ", absl::StrJoin(stuck, ", "),
                                    " wait for data that is never sent or computed"),
                   marks);
  }
  for (int r = 0; r < R; ++r) res.makespan = std::max(res.makespan, t[r]);
  res.bubble_fraction.resize(R);
  double sum = 0;
  for (int r = 0; r < R; ++r) {
    res.bubble_fraction[r] = res.makespan > 0 ? 1.0 - res.busy[r] / res.makespan : 0.0;
    sum += res.bubble_fraction[r];
  }
  res.mean_bubble_fraction = sum / R;
  return res;
}

std::string RenderTimeline(const Schedule& sc, const SimulationResult& res) {
  // One cell per unit of the smallest compute cost.
  double unit = 1e30;
  for (const auto& row : res.timeline) {
    for (const TimedAction& ta : row) {
      if (ta.end > ta.start) unit = std::min(unit, ta.end - ta.start);
    }
  }
  if (unit == 1e30) return "";
  const int cells = static_cast<int>(std::ceil(res.makespan / unit - 1e-9));
  size_t width = 3;
  for (const auto& row : res.timeline) {
    for (const TimedAction& ta : row) width = std::max(width, ta.action.ToString().size());
  }
  std::string out;
  for (int r = 0; r < sc.num_ranks; ++r) {
    std::vector<std::string> grid(cells, ".");
    for (const TimedAction& ta : res.timeline[r]) {
      if (!ta.action.IsCompute()) continue;
      int a = static_cast<int>(std::floor(ta.start / unit + 1e-9));
      int b = static_cast<int>(std::ceil(ta.end / unit - 1e-9));
      for (int c = a; c < b && c < cells; ++c) grid[c] = c == a ? ta.action.ToString() : "~";
    }
    std::string row = absl::StrFormat("rank %-3d|", r);
    for (const std::string& g : grid) absl::StrAppend(&row, " ", absl::StrFormat("%-*s", static_cast<int>(width), g));
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  return out;
}

std::string RenderSvg(const Schedule& sc, const SimulationResult& res) {
  const double scale = 800.0 / std::max(res.makespan, 1e-9);
  const int row_h = 28, left = 70, top = 30;
  const int height = top + row_h * sc.num_ranks + 40;
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"monospace\" "
      "font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"18\">%s: %d ranks, %d stages, %d micro-batches, makespan %.2f, bubble %.1f%%</text>\n",
      left + 820, height, left, sc.name, sc.num_ranks, sc.num_stages, sc.num_microbatches, res.makespan,
      100 * res.mean_bubble_fraction);
  for (int r = 0; r < sc.num_ranks; ++r) {
    int y = top + r * row_h;
    absl::StrAppend(&out, absl::StrFormat("<text x=\"4\" y=\"%d\">rank %d</text>\n", y + 18, r));
    absl::StrAppend(&out, absl::StrFormat(
                              "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#eeeeee\" "
                              "stroke=\"#cccccc\"><title>idle</title></rect>\n",
                              left, y + 2, res.makespan * scale, row_h - 4));
    for (const TimedAction& ta : res.timeline[r]) {
      if (!ta.action.IsCompute()) continue;
      const char* color = "#4c78a8";
      switch (ta.action.type) {
        case ActionType::kBackward: color = "#54a24b"; break;
        case ActionType::kBackwardInput: color = "#f58518"; break;
        case ActionType::kBackwardWeight: color = "#b279a2"; break;
        default: break;
      }
      double x = left + ta.start * scale, w = (ta.end - ta.start) * scale;
      absl::StrAppend(&out, absl::StrFormat(
                                "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\" "
                                "stroke=\"white\"><title>%s [%.2f, %.2f)</title></rect>\n",
                                x, y + 2, w, row_h - 4, color, ta.action.ToString(), ta.start, ta.end));
      if (w >= 18) {
        absl::StrAppend(&out, absl::StrFormat("<text x=\"%.1f\" y=\"%d\" fill=\"white\">%s</text>\n", x + 2,
                                              y + 18, ta.action.ToString()));
      }
    }
  }
  int y = top + row_h * sc.num_ranks + 20;
  absl::StrAppend(&out, absl::StrFormat(
                            "<text x=\"%d\" y=\"%d\"><tspan fill=\"#4c78a8\">F forward</tspan>  "
                            "<tspan fill=\"#54a24b\">B backward</tspan>  <tspan fill=\"#f58518\">I input "
                            "grad</tspan>  <tspan fill=\"#b279a2\">W weight grad</tspan>  grey: idle</text>\n",
                            left, y));
  out += "</svg>\n";
  return out;
}

}  // namespace pippy::schedule
