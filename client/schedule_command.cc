#include "client/schedule_command.h"

#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/args.h"
#include "client/exit_codes.h"
#include "client/table.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::cli {
namespace {

using schedule::Schedule;

constexpr char kHelp[] = R"(usage: pippyctl schedule --schedule NAME --ranks R [--stages S] --microbatches M
                         [--costs F,B,W] [--csv FILE] [--from-csv FILE] [--svg FILE]
                         [--output table|json]

Generates a pipeline schedule as per-rank action lists (torch.distributed.pipelining
notation: 0F3 = stage 0 forward of micro-batch 3; B full backward; I/W backward for
inputs/weights; SEND_F, RECV_F, SEND_B, RECV_B), validates it, simulates it and prints
the timeline, the bubble fraction per rank and the peak live activations per rank.

  --schedule NAME   gpipe | 1f1b | interleaved-1f1b | looped-bfs | zb1p | zbv | inference
                    (torch's names work too: GPipe, Interleaved1F1B, ZBVZeroBubble, ...)
  --ranks R         pipeline ranks (workers)
  --stages S        total stages (a multiple of R; default R, or 2R for interleaved-1f1b,
                    looped-bfs and zbv; zbv needs exactly 2R)
  --microbatches M  micro-batches per step
  --costs F,B,W     action costs: forward, backward for inputs, backward for weights
                    (a full backward B costs B+W); default 1,1,1
  --csv FILE        write the schedule in torch's CSV format (one row per rank)
  --from-csv FILE   read a schedule from torch's CSV format instead of generating one;
                    compute-only schedules get SEND/RECV actions inserted
  --svg FILE        draw the timeline (one row per rank, F/B/I/W blocks, idle visible)
  --output          table (default) or json

Preconditions: 1f1b, zb1p and zbv need micro-batches >= ranks; interleaved-1f1b needs
micro-batches to be a multiple of ranks. Exit codes: 0 valid, 2 bad input or a schedule
that is invalid or deadlocks (the grid marks where each rank is stuck).
)";

std::string Json(const Schedule& s, const schedule::SimulationResult& r) {
  std::string out = absl::StrFormat(
      "{\"schedule\": \"%s\", \"ranks\": %d, \"stages\": %d, \"microbatches\": %d, \"makespan\": %g, "
      "\"mean_bubble_fraction\": %g, \"per_rank\": [",
      s.name, s.num_ranks, s.num_stages, s.num_microbatches, r.makespan, r.mean_bubble_fraction);
  for (int i = 0; i < s.num_ranks; ++i) {
    std::string actions;
    for (const auto& a : s.ranks[i]) absl::StrAppend(&actions, actions.empty() ? "" : ", ", "\"", a.ToString(), "\"");
    absl::StrAppend(&out, i ? ", " : "",
                    absl::StrFormat("{\"rank\": %d, \"busy\": %g, \"bubble_fraction\": %g, \"peak_live\": %d, "
                                    "\"actions\": [%s]}",
                                    i, r.busy[i], r.bubble_fraction[i], r.peak_live_per_rank[i], actions));
  }
  return out + "]}";
}

}  // namespace

int RunScheduleCommand(int argc, char** argv, int first) {
  auto args = Args::Parse(argc, argv, first,
                          {{"schedule"}, {"ranks"}, {"stages"}, {"microbatches"}, {"costs"}, {"csv"},
                           {"from-csv"}, {"svg"}, {"output"}});
  if (!args.ok()) return Fail(args.status());
  if (args->Has("help")) {
    std::cout << kHelp;
    return kExitOk;
  }
  if (!args->positional().empty()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args->positional()[0], "'")));
  }
  auto costs = schedule::ParseCosts(args->Get("costs", "1,1,1"));
  if (!costs.ok()) return Fail(costs.status());
  const std::string output = args->Get("output", "table");
  if (output != "table" && output != "json") return Fail(absl::InvalidArgumentError("--output must be table or json"));

  Schedule sched;
  if (args->Has("from-csv")) {
    std::ifstream in(args->Get("from-csv"));
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("cannot open '", args->Get("from-csv"), "'")));
    std::stringstream buf;
    buf << in.rdbuf();
    auto s = schedule::FromCsv(buf.str());
    if (!s.ok()) return Fail(s.status());
    sched = *s;
  } else {
    if (!args->Has("schedule") || !args->Has("ranks") || !args->Has("microbatches")) {
      return Fail(absl::InvalidArgumentError(
          "schedule needs --schedule NAME --ranks R --microbatches M (or --from-csv FILE); see --help"));
    }
    auto kind = schedule::ParseScheduleKind(args->Get("schedule"));
    if (!kind.ok()) return Fail(kind.status());
    auto ranks = args->GetInt("ranks", 1);
    auto mbs = args->GetInt("microbatches", 1);
    if (!ranks.ok()) return Fail(ranks.status());
    if (!mbs.ok()) return Fail(mbs.status());
    auto stages = args->GetInt("stages", *ranks * schedule::DefaultStagesPerRank(*kind));
    if (!stages.ok()) return Fail(stages.status());
    if (*ranks < 1 || *stages % *ranks != 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--stages (", *stages, ") must be a positive multiple of --ranks (", *ranks, ")")));
    }
    schedule::ScheduleOptions opts;
    opts.num_ranks = *ranks;
    opts.num_microbatches = *mbs;
    opts.stages_per_rank = *stages / *ranks;
    auto s = schedule::MakeSchedule(*kind, opts);
    if (!s.ok()) return Fail(s.status());
    sched = *s;
  }
  auto result = schedule::Simulate(sched, *costs);
  if (!result.ok()) return Fail(result.status());
  if (args->Has("csv")) {
    std::ofstream out(args->Get("csv"));
    out << schedule::ToCsv(sched);
    if (!out) return Fail(absl::PermissionDeniedError(absl::StrCat("cannot write '", args->Get("csv"), "'")));
  }
  if (args->Has("svg")) {
    std::ofstream out(args->Get("svg"));
    out << schedule::RenderSvg(sched, *result);
    if (!out) return Fail(absl::PermissionDeniedError(absl::StrCat("cannot write '", args->Get("svg"), "'")));
  }
  if (output == "json") {
    std::cout << Json(sched, *result) << "\n";
    return kExitOk;
  }
  std::cout << absl::StrFormat("%s: %d ranks, %d stages, %d micro-batches; costs F=%g B=%g W=%g\n\n", sched.name,
                               sched.num_ranks, sched.num_stages, sched.num_microbatches, costs->forward,
                               costs->backward_input, costs->backward_weight);
  std::cout << schedule::RenderTimeline(sched, *result) << "\n";
  Table table({"rank", "stages", "busy", "idle", "bubble", "peak live activations"});
  for (int r = 0; r < sched.num_ranks; ++r) {
    std::string stages;
    for (int s : sched.StagesOf(r)) absl::StrAppend(&stages, stages.empty() ? "" : ",", s);
    table.AddRow({absl::StrCat(r), stages, absl::StrFormat("%g", result->busy[r]),
                  absl::StrFormat("%g", result->makespan - result->busy[r]),
                  absl::StrFormat("%.1f%%", 100 * result->bubble_fraction[r]),
                  absl::StrCat(result->peak_live_per_rank[r])});
  }
  std::cout << table.Render();
  std::cout << absl::StrFormat("\nmakespan %g, mean bubble %.1f%%\n", result->makespan,
                               100 * result->mean_bubble_fraction);
  return kExitOk;
}

}  // namespace pippy::cli
