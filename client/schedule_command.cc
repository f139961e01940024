// `pippyctl schedule`: generates, validates and simulates a schedule; prints its timeline.
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/commands.h"
#include "client/table.h"
#include "common/cli.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::cli {
namespace {

using schedule::Schedule;

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

struct ScheduleFlags {
  std::string schedule;
  int ranks = 0;
  int stages = 0;
  int microbatches = 0;
  std::string costs = "1,1,1";
  std::string csv, from_csv, svg;
};

int RunSchedule(const ScheduleFlags& f, const GlobalFlags& g) {
  auto costs = schedule::ParseCosts(f.costs);
  if (!costs.ok()) return Fail(kProgram, costs.status());
  Schedule sched;
  if (!f.from_csv.empty()) {
    std::ifstream in(f.from_csv);
    if (!in) return Fail(kProgram, absl::NotFoundError(absl::StrCat("cannot open '", f.from_csv, "'")));
    std::stringstream buf;
    buf << in.rdbuf();
    auto s = schedule::FromCsv(buf.str());
    if (!s.ok()) return Fail(kProgram, s.status());
    sched = *s;
  } else {
    if (f.schedule.empty() || f.ranks == 0 || f.microbatches == 0) {
      return Fail(kProgram, absl::InvalidArgumentError(
                                "schedule needs --schedule NAME --ranks R --microbatches M (or --from-csv FILE); "
                                "see pippyctl schedule --help"));
    }
    auto kind = job::ParseSchedule(f.schedule);
    if (!kind.ok()) return Fail(kProgram, kind.status());
    const int stages = f.stages > 0 ? f.stages : f.ranks * schedule::DefaultStagesPerRank(*kind);
    if (stages % f.ranks != 0) {
      return Fail(kProgram, absl::InvalidArgumentError(absl::StrCat("--stages (", stages,
                                                                    ") must be a multiple of --ranks (", f.ranks, ")")));
    }
    schedule::ScheduleOptions opts;
    opts.num_ranks = f.ranks;
    opts.num_microbatches = f.microbatches;
    opts.stages_per_rank = stages / f.ranks;
    auto s = schedule::MakeSchedule(*kind, opts);
    if (!s.ok()) return Fail(kProgram, s.status());
    sched = *s;
  }
  auto result = schedule::Simulate(sched, *costs);
  if (!result.ok()) return Fail(kProgram, result.status());
  if (!f.csv.empty()) {
    std::ofstream out(f.csv);
    out << schedule::ToCsv(sched);
    if (!out) return Fail(kProgram, absl::PermissionDeniedError(absl::StrCat("cannot write '", f.csv, "'")));
  }
  if (!f.svg.empty()) {
    std::ofstream out(f.svg);
    out << schedule::RenderSvg(sched, *result);
    if (!out) return Fail(kProgram, absl::PermissionDeniedError(absl::StrCat("cannot write '", f.svg, "'")));
  }
  if (g.output == "json") {
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

}  // namespace

void AddScheduleCommand(CLI::App& root, const GlobalFlags& globals, int* exit_code) {
  auto f = std::make_shared<ScheduleFlags>();
  CLI::App* cmd = root.add_subcommand(
      "schedule",
      "Generate a pipeline schedule as per-rank action lists (torch.distributed.pipelining notation: 0F3 = "
      "stage 0 forward of micro-batch 3; B full backward; I/W backward for inputs/weights; SEND_F, RECV_F, "
      "SEND_B, RECV_B), validate it (a deadlock prints the rank x step grid with each rank's stuck action), "
      "simulate it and print the timeline, the bubble fraction and the peak live activations per rank. "
      "Preconditions: 1f1b, zb1p and zbv need micro-batches >= ranks; interleaved-1f1b needs micro-batches "
      "to be a multiple of ranks.");
  cmd->fallthrough();
  cli::AddNameOption<ScheduleKind>(cmd, "--schedule", &f->schedule, "schedule", "the schedule to generate");
  cmd->add_option("--ranks", f->ranks, "pipeline ranks (workers)")->check(cli::Positive());
  cmd->add_option("--stages", f->stages,
                  "total stages, a multiple of --ranks (default: ranks, or 2 x ranks for interleaved-1f1b, "
                  "looped-bfs and zbv; zbv needs exactly 2 x ranks)")
      ->check(cli::Positive());
  cmd->add_option("--microbatches", f->microbatches, "micro-batches per step")->check(cli::Positive());
  cmd->add_option("--costs", f->costs,
                  "action costs F,B,W: forward, backward for inputs, backward for weights (a full backward B "
                  "costs B+W)");
  cmd->add_option("--csv", f->csv, "write the schedule in torch's CSV format (one row per rank)");
  cmd->add_option("--from-csv", f->from_csv,
                  "read a schedule in torch's CSV format instead of generating one (compute-only schedules get "
                  "SEND/RECV inserted)");
  cmd->add_option("--svg", f->svg, "draw the timeline (one row per rank, F/B/I/W blocks, idle visible)");
  cmd->callback([f, &globals, exit_code] { *exit_code = RunSchedule(*f, globals); });
}

}  // namespace pippy::cli
