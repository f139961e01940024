#include "pipeline/schedule/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "proto/names.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pippy::schedule {
namespace {

Action F(int s, int mb) { return {s, ActionType::kForward, mb}; }
Action B(int s, int mb) { return {s, ActionType::kBackward, mb}; }
Action I(int s, int mb) { return {s, ActionType::kBackwardInput, mb}; }
Action W(int s, int mb) { return {s, ActionType::kBackwardWeight, mb}; }

void GPipe(Schedule* sc) {
  const int m = sc->num_microbatches;
  for (int r = 0; r < sc->num_ranks; ++r) {
    for (int mb = 0; mb < m; ++mb) sc->ranks[r].push_back(F(r, mb));
    for (int mb = 0; mb < m; ++mb) sc->ranks[r].push_back(B(r, mb));
  }
}

void OneFOneB(Schedule* sc) {
  const int m = sc->num_microbatches, p = sc->num_ranks;
  for (int r = 0; r < p; ++r) {
    ActionList& l = sc->ranks[r];
    const int warmup = std::min(p - r - 1, m);
    for (int mb = 0; mb < warmup; ++mb) l.push_back(F(r, mb));
    for (int i = 0; i < m - warmup; ++i) {
      l.push_back(F(r, warmup + i));
      l.push_back(B(r, i));
    }
    for (int mb = m - warmup; mb < m; ++mb) l.push_back(B(r, mb));
  }
}

// Megatron-LM's interleaved 1F1B with V chunks per rank (loop placement).
void Interleaved1F1B(Schedule* sc, int v) {
  const int m = sc->num_microbatches, R = sc->num_ranks;
  const int n = m * v;
  for (int r = 0; r < R; ++r) {
    auto fwd = [&](int k) {
      int chunk = (k / R) % v;
      int mb = (k / (R * v)) * R + k % R;
      return F(chunk * R + r, mb);
    };
    auto bwd = [&](int k) {
      int chunk = v - 1 - (k / R) % v;
      int mb = (k / (R * v)) * R + k % R;
      return B(chunk * R + r, mb);
    };
    ActionList& l = sc->ranks[r];
    const int warmup = std::min((R - r - 1) * 2 + (v - 1) * R, n);
    for (int k = 0; k < warmup; ++k) l.push_back(fwd(k));
    for (int i = 0; i < n - warmup; ++i) {
      l.push_back(fwd(warmup + i));
      l.push_back(bwd(i));
    }
    for (int k = n - warmup; k < n; ++k) l.push_back(bwd(k));
  }
}

void LoopedBFS(Schedule* sc) {
  const int m = sc->num_microbatches;
  for (int r = 0; r < sc->num_ranks; ++r) {
    std::vector<int> stages = sc->StagesOf(r);
    for (int s : stages) {
      for (int mb = 0; mb < m; ++mb) sc->ranks[r].push_back(F(s, mb));
    }
    // Backward: last local stage first; micro-batches in order (torch runs them in
    // reverse; ascending keeps gradient accumulation in the unsplit model's order).
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      for (int mb = 0; mb < m; ++mb) sc->ranks[r].push_back(B(*it, mb));
    }
  }
}

void ForwardOnly(Schedule* sc) {
  for (int mb = 0; mb < sc->num_microbatches; ++mb) {
    for (int s = 0; s < sc->num_stages; ++s) sc->ranks[sc->stage_to_rank[s]].push_back(F(s, mb));
  }
}

// Zero-bubble schedules by greedy list scheduling with unit costs (F = I = W), the way
// the Zero Bubble paper's heuristic works: a free rank runs, in priority order, a
// ready backward-for-inputs (I, on the critical path), a forward (if fewer than
// `limit_i[r]` micro-batches wait for their I and fewer than `limit_w[r]` hold
// activations until their W), else a weight backward (W), which so fills what would
// be a bubble. Returns false if the limits stall it.
bool GreedyZeroBubble(Schedule* sc, const std::vector<int>& limit_i, const std::vector<int>& limit_w) {
  const int S = sc->num_stages, m = sc->num_microbatches, R = sc->num_ranks;
  const double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> f_done(S, std::vector<double>(m, kInf)), i_done = f_done;
  std::vector<std::vector<bool>> w_done(S, std::vector<bool>(m, false));
  std::vector<int> next_f(S, 0), live(R, 0), awaiting_i(R, 0);
  std::vector<double> t(R, 0.0);
  std::vector<std::vector<int>> stages(R);
  for (int r = 0; r < R; ++r) stages[r] = sc->StagesOf(r);
  int remaining = 3 * S * m;
  while (remaining > 0) {
    // For each rank: the earliest action it can start, by priority at that time.
    int best_rank = -1;
    double best_time = kInf;
    Action best_action;
    for (int r = 0; r < R; ++r) {
      double when_i = kInf, when_f = kInf, when_w = kInf;
      Action ai, af, aw;
      for (int s : stages[r]) {
        for (int mb = 0; mb < m; ++mb) {
          if (f_done[s][mb] == kInf || i_done[s][mb] != kInf) continue;
          double ready = f_done[s][mb];
          for (int c : sc->graph.consumers[s]) ready = std::max(ready, i_done[c][mb]);
          ready = std::max(ready, t[r]);
          if (ready < when_i || (ready == when_i && s > ai.stage)) {
            when_i = ready;
            ai = I(s, mb);
          }
          break;  // I in micro-batch order per stage
        }
        if (next_f[s] < m && awaiting_i[r] < limit_i[r] && live[r] < limit_w[r]) {
          int mb = next_f[s];
          double ready = t[r];
          for (int p : sc->graph.Producers(s)) ready = std::max(ready, f_done[p][mb]);
          if (ready < when_f || (ready == when_f && s > af.stage)) {
            when_f = ready;
            af = F(s, mb);
          }
        }
        for (int mb = 0; mb < m; ++mb) {
          if (i_done[s][mb] != kInf && !w_done[s][mb]) {
            double ready = std::max(t[r], i_done[s][mb]);
            if (ready < when_w) {
              when_w = ready;
              aw = W(s, mb);
            }
            break;
          }
        }
      }
      // At the earliest time anything is possible, take the highest priority ready one.
      double now = std::min({when_i, when_f, when_w});
      if (now == kInf) continue;
      Action pick = when_i <= now ? ai : (when_f <= now ? af : aw);
      if (now < best_time) {
        best_time = now;
        best_rank = r;
        best_action = pick;
      }
    }
    if (best_rank < 0) return false;
    const int r = best_rank;
    const Action& a = best_action;
    const double end = best_time + 1.0;
    t[r] = end;
    if (a.type == ActionType::kForward) {
      f_done[a.stage][a.microbatch] = end;
      ++next_f[a.stage];
      ++live[r];
      ++awaiting_i[r];
    } else if (a.type == ActionType::kBackwardInput) {
      i_done[a.stage][a.microbatch] = end;
      --awaiting_i[r];
    } else {
      w_done[a.stage][a.microbatch] = true;
      --live[r];
    }
    sc->ranks[r].push_back(a);
    --remaining;
  }
  return true;
}

absl::Status ZeroBubble(Schedule* sc, bool v_shape) {
  const int R = sc->num_ranks;
  const int v = sc->num_stages / R;
  // Micro-batches awaiting I: 1F1B's in-flight count (R - r per stage chunk); holding
  // activations until W: 1F1B's peak (R per chunk), so no rank needs more memory than
  // 1F1B's first rank. Relaxed step by step if the greedy stalls.
  for (int extra = 0; extra <= sc->num_microbatches * v; ++extra) {
    std::vector<int> limit_i(R), limit_w(R);
    for (int r = 0; r < R; ++r) {
      limit_i[r] = (v_shape ? 2 * R : v * (R - r)) + extra;
      limit_w[r] = v * R + (R - r - 1) + extra;
    }
    for (auto& l : sc->ranks) l.clear();
    if (GreedyZeroBubble(sc, limit_i, limit_w)) return absl::OkStatus();
  }
  return absl::InternalError("zero-bubble generator stalled (schedule generator bug)");
}

bool IsBackwardCompute(ActionType t) {
  return t == ActionType::kBackward || t == ActionType::kBackwardInput;
}

}  // namespace

StageGraph StageGraph::Chain(int num_stages) {
  StageGraph g;
  g.consumers.resize(num_stages);
  for (int s = 0; s + 1 < num_stages; ++s) g.consumers[s].push_back(s + 1);
  return g;
}

std::vector<int> StageGraph::Producers(int stage) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages(); ++s) {
    for (int c : consumers[s]) {
      if (c == stage) out.push_back(s);
    }
  }
  return out;
}

std::vector<int> Schedule::StagesOf(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages; ++s) {
    if (stage_to_rank[s] == rank) out.push_back(s);
  }
  return out;
}

bool Schedule::HasCommunication() const {
  for (const auto& l : ranks) {
    for (const Action& a : l) {
      if (a.IsComm()) return true;
    }
  }
  return false;
}

int DefaultStagesPerRank(ScheduleKind kind) {
  switch (kind) {
    case SCHEDULE_INTERLEAVED_1F1B:
    case SCHEDULE_LOOPED_BFS:
    case SCHEDULE_ZBV:
      return 2;
    default:
      return 1;
  }
}

std::vector<int> Placement(ScheduleKind kind, int num_ranks, int num_stages) {
  std::vector<int> out(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    out[s] = kind == SCHEDULE_ZBV ? (s < num_ranks ? s : 2 * num_ranks - 1 - s) : s % num_ranks;
  }
  return out;
}

absl::StatusOr<Schedule> MakeSchedule(ScheduleKind kind, const ScheduleOptions& options) {
  const int R = options.num_ranks, m = options.num_microbatches;
  if (kind == SCHEDULE_KIND_UNSPECIFIED || !ScheduleKind_IsValid(kind)) {
    return absl::InvalidArgumentError(absl::StrCat("schedule kind ", static_cast<int>(kind), " is not a schedule: use ",
                                                   names::NameList(ScheduleKind_descriptor())));
  }
  const std::string name = names::Name(kind);
  if (R < 1) return absl::InvalidArgumentError("a schedule needs at least 1 rank");
  if (m < 1) return absl::InvalidArgumentError("a schedule needs at least 1 micro-batch");
  int v = options.stages_per_rank > 0 ? options.stages_per_rank : DefaultStagesPerRank(kind);
  if ((kind == SCHEDULE_GPIPE || kind == SCHEDULE_1F1B) && v != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " runs one stage per rank (asked for ", v,
        "); use interleaved-1f1b, looped-bfs or zb1p for several"));
  }
  if (kind == SCHEDULE_ZBV && v != 2) {
    return absl::InvalidArgumentError(absl::StrCat("zbv runs exactly 2 stages per rank (asked for ", v, ")"));
  }
  if ((kind == SCHEDULE_1F1B || kind == SCHEDULE_ZB1P ||
       kind == SCHEDULE_ZBV) && m < R) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " needs at least as many micro-batches as ranks (", m, " < ", R,
        "): use --microbatches ", R, " or more, or gpipe"));
  }
  if (kind == SCHEDULE_INTERLEAVED_1F1B && m % R != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "interleaved-1f1b needs micro-batches to be a multiple of ranks (", m, " micro-batches, ", R,
        " ranks): use --microbatches ", ((m + R - 1) / R) * R));
  }
  Schedule sc;
  sc.name = name;
  sc.num_ranks = R;
  sc.num_stages = R * v;
  sc.num_microbatches = m;
  sc.forward_only = kind == SCHEDULE_INFERENCE;
  sc.graph = options.graph.num_stages() > 0 ? options.graph : StageGraph::Chain(sc.num_stages);
  if (sc.graph.num_stages() != sc.num_stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " with ", R, " ranks and ", v, " stage(s) per rank runs ", sc.num_stages,
        " stages, but the model was split into ", sc.graph.num_stages()));
  }
  sc.stage_to_rank = Placement(kind, R, sc.num_stages);
  sc.ranks.assign(R, {});
  switch (kind) {
    case SCHEDULE_GPIPE: GPipe(&sc); break;
    case SCHEDULE_1F1B: OneFOneB(&sc); break;
    case SCHEDULE_INTERLEAVED_1F1B: Interleaved1F1B(&sc, v); break;
    case SCHEDULE_LOOPED_BFS: LoopedBFS(&sc); break;
    case SCHEDULE_INFERENCE: ForwardOnly(&sc); break;
    case SCHEDULE_ZB1P:
    case SCHEDULE_ZBV: {
      absl::Status s = ZeroBubble(&sc, kind == SCHEDULE_ZBV);
      if (!s.ok()) return s;
      break;
    }
    default:  // refused above
      return absl::InternalError(absl::StrCat("schedule kind ", static_cast<int>(kind), " has no generator"));
  }
  InsertCommunication(&sc);
  return sc;
}

void InsertCommunication(Schedule* sc) {
  auto remote = [&](int rank, const std::vector<int>& stages) {
    return std::any_of(stages.begin(), stages.end(),
                       [&](int s) { return sc->stage_to_rank[s] != rank; });
  };
  for (int r = 0; r < sc->num_ranks; ++r) {
    ActionList out;
    for (const Action& a : sc->ranks[r]) {
      const std::vector<int>& consumers = sc->graph.consumers[a.stage];
      const std::vector<int> producers = sc->graph.Producers(a.stage);
      if (a.type == ActionType::kForward) {
        if (remote(r, producers)) out.push_back({a.stage, ActionType::kRecvForward, a.microbatch});
        out.push_back(a);
        if (remote(r, consumers)) out.push_back({a.stage, ActionType::kSendForward, a.microbatch});
      } else if (IsBackwardCompute(a.type)) {
        if (remote(r, consumers)) out.push_back({a.stage, ActionType::kRecvBackward, a.microbatch});
        out.push_back(a);
        if (remote(r, producers)) out.push_back({a.stage, ActionType::kSendBackward, a.microbatch});
      } else {
        out.push_back(a);
      }
    }
    sc->ranks[r] = std::move(out);
  }
}

std::string ToCsv(const Schedule& sc) {
  std::string out;
  for (const ActionList& l : sc.ranks) {
    std::vector<std::string> cells;
    for (const Action& a : l) cells.push_back(a.ToString());
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

absl::StatusOr<Schedule> FromCsv(const std::string& csv, const StageGraph& graph) {
  Schedule sc;
  sc.name = "csv";
  std::vector<std::string> rows = absl::StrSplit(csv, '\n');
  while (!rows.empty() && absl::StripAsciiWhitespace(rows.back()).empty()) rows.pop_back();
  if (rows.empty()) return absl::InvalidArgumentError("the CSV schedule is empty: one row per rank expected");
  int max_stage = -1, max_mb = -1;
  std::map<int, int> stage_rank;
  bool training = false;
  for (size_t r = 0; r < rows.size(); ++r) {
    ActionList list;
    std::vector<std::string> cells = absl::StrSplit(rows[r], ',');
    for (size_t c = 0; c < cells.size(); ++c) {
      std::string cell(absl::StripAsciiWhitespace(cells[c]));
      if (cell.empty() || cell == "None") continue;
      auto a = ParseAction(cell);
      if (!a.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("CSV row ", r, " (rank ", r, "), cell ", c, ": ",
                                                       a.status().message()));
      }
      if (a->IsCompute()) {
        auto [it, inserted] = stage_rank.emplace(a->stage, static_cast<int>(r));
        if (!inserted && it->second != static_cast<int>(r)) {
          return absl::InvalidArgumentError(absl::StrCat("CSV: stage ", a->stage, " has compute actions on rank ",
                                                         it->second, " and rank ", r,
                                                         "; a stage lives on one rank"));
        }
        if (a->type != ActionType::kForward) training = true;
      }
      max_stage = std::max(max_stage, a->stage);
      max_mb = std::max(max_mb, a->microbatch);
      list.push_back(*a);
    }
    if (list.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("CSV row ", r, " (rank ", r,
                                                     ") has no action; every rank of a schedule runs some"));
    }
    sc.ranks.push_back(std::move(list));
  }
  if (stage_rank.empty()) {
    return absl::InvalidArgumentError("the CSV schedule has no compute action (F, B, I or W): nothing to run");
  }
  // Every stage needs a compute action of its own, and every micro-batch a forward:
  // numbers beyond the count of compute actions cannot all be there (this is checked
  // before anything is sized by them).
  size_t computes = 0;
  for (const ActionList& l : sc.ranks) {
    computes += static_cast<size_t>(std::count_if(l.begin(), l.end(), [](const Action& a) { return a.IsCompute(); }));
  }
  if (static_cast<size_t>(max_stage) >= stage_rank.size()) {
    for (int s = 0;; ++s) {
      if (stage_rank.count(s) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("CSV: stage ", s, " has no compute action on any rank"));
      }
    }
  }
  if (static_cast<size_t>(max_mb) >= computes) {
    return absl::InvalidArgumentError(absl::StrCat("CSV: micro-batch ", max_mb, " is named, but there are only ",
                                                   computes, " compute actions; micro-batches are numbered from 0"));
  }
  sc.num_ranks = static_cast<int>(sc.ranks.size());
  sc.num_stages = max_stage + 1;
  sc.num_microbatches = max_mb + 1;
  sc.forward_only = !training;
  sc.stage_to_rank.assign(sc.num_stages, -1);
  for (int s = 0; s < sc.num_stages; ++s) {
    auto it = stage_rank.find(s);
    if (it == stage_rank.end()) {
      return absl::InvalidArgumentError(absl::StrCat("CSV: stage ", s, " has no compute action on any rank"));
    }
    sc.stage_to_rank[s] = it->second;
  }
  sc.graph = graph.num_stages() > 0 ? graph : StageGraph::Chain(sc.num_stages);
  if (sc.graph.num_stages() != sc.num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("CSV schedule has ", sc.num_stages,
                                                   " stages but the model has ", sc.graph.num_stages()));
  }
  if (!sc.HasCommunication()) InsertCommunication(&sc);
  return sc;
}

}  // namespace pippy::schedule
