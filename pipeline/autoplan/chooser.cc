#include "pipeline/autoplan/chooser.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipeline/autoplan/calibration.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::autoplan {
namespace {

bool Training(const JobSpec& spec) { return spec.mode() == MODE_TRAIN; }

// The stages a worker of `kind` holds: the spec's where it gives the schedule and them.
int StagesPerWorker(const JobSpec& spec, ScheduleKind kind) {
  return spec.auto_plan().schedule() || spec.schedule().stages_per_worker() == 0 ? schedule::DefaultStagesPerRank(kind)
                                                                                 : spec.schedule().stages_per_worker();
}

int Replicas(const JobSpec& spec) { return std::max(1, spec.replicas()); }

// Optimizer state per parameter byte: SGD with momentum one buffer, Adam two.
double StateFactor(const JobSpec& spec) {
  switch (spec.optimizer().kind()) {
    case OPTIMIZER_ADAM:
    case OPTIMIZER_ADAMW:
      return 2;
    default:
      return spec.optimizer().momentum() > 0 ? 1 : 0;
  }
}

int SizeIndex(const ModelProfile& profile, int64_t size) {
  for (int i = 0; i < profile.microbatch_sizes_size(); ++i) {
    if (profile.microbatch_sizes(i) == size) return i;
  }
  return -1;
}

// The spans [0, n) split into k contiguous groups with the least largest sum: the
// index where each group after the first starts.
std::vector<int> MinMaxGroups(const std::vector<double>& c, int k) {
  const int n = static_cast<int>(c.size());
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + c[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[g][i]: the least largest sum of the first i spans in g groups; from[g][i] where the last starts.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> from(k + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int g = 1; g <= k; ++g) {
    for (int i = g; i <= n; ++i) {
      for (int j = g - 1; j < i; ++j) {
        const double v = std::max(best[g - 1][j], prefix[i] - prefix[j]);
        if (v < best[g][i]) {
          best[g][i] = v;
          from[g][i] = j;
        }
      }
    }
  }
  std::vector<int> starts;
  for (int g = k, i = n; g > 1; --g) {
    i = from[g][i];
    starts.push_back(i);
  }
  std::reverse(starts.begin(), starts.end());
  return starts;
}

std::vector<ScheduleKind> KindsFor(const JobSpec& spec) {
  if (!spec.auto_plan().schedule()) return {spec.schedule().kind()};
  if (!Training(spec)) return {SCHEDULE_INFERENCE};
  return {SCHEDULE_GPIPE, SCHEDULE_1F1B, SCHEDULE_ZB1P, SCHEDULE_INTERLEAVED_1F1B, SCHEDULE_ZBV};
}

std::string Mib(int64_t bytes) { return absl::StrFormat("%.0f MiB", static_cast<double>(bytes) / (1 << 20)); }

std::string Describe(const PlanCandidate& c) {
  return absl::StrCat(job::ScheduleName(c.schedule()), " with ", c.microbatches(), " micro-batch",
                      c.microbatches() == 1 ? "" : "es", ", ", c.stages(), " stage", c.stages() == 1 ? "" : "s",
                      " on ", c.workers(), " worker", c.workers() == 1 ? "" : "s");
}

double PerSampleUs(const PlanCandidate& c, int64_t batch) {
  double sum = 0;
  for (double v : c.stage_compute_us()) sum += v;
  return sum * c.microbatches() / static_cast<double>(batch);
}

// Why `win` beat `other`, in the dimension they differ in most.
std::string Versus(const PlanCandidate& win, const PlanCandidate& other, int64_t batch) {
  const double gain = win.samples_per_second() / std::max(1e-9, other.samples_per_second()) - 1;
  if (gain < 0.005) {
    return absl::StrFormat("%s: %.1f samples/s, as fast (the simpler plan is preferred)", Describe(other),
                           other.samples_per_second());
  }
  std::string cause;
  const double per_sample_ratio = PerSampleUs(other, batch) / std::max(1e-9, PerSampleUs(win, batch));
  if (other.bubble_fraction() > win.bubble_fraction() + 0.02) {
    cause = absl::StrFormat("its bubble is %.0f%% against %.0f%%", 100 * other.bubble_fraction(),
                            100 * win.bubble_fraction());
  }
  if (per_sample_ratio > 1.03) {
    if (!cause.empty()) cause += ", and ";
    cause += absl::StrFormat("its compute per sample is %.2fx (smaller micro-batches, or workers sharing cores)",
                             per_sample_ratio);
  }
  if (cause.empty()) cause = "the slowest rank is busier";
  return absl::StrFormat("%s: %.1f samples/s, %.1f%% slower (%s)", Describe(other), other.samples_per_second(),
                         100 * gain / (1 + gain), cause);
}

}  // namespace

LinkModel DefaultLink() {
  LinkModel l;
  l.set_latency_us(60);
  l.set_bytes_per_second(2e9);
  return l;
}

absl::StatusOr<PlanCandidate> Predict(const JobSpec& spec, const ModelProfile& profile, ScheduleKind kind,
                                      int microbatches, int ranks, int stages_per_worker,
                                      const std::vector<WorkerCapacity>& workers, const LinkModel& link) {
  const bool train = Training(spec);
  const int replicas = Replicas(spec);
  const int64_t batch = spec.batch_size();
  if (microbatches < 1 || ranks < 1) return absl::InvalidArgumentError("micro-batches and ranks must be at least 1");
  if (batch % (static_cast<int64_t>(replicas) * microbatches) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the batch of ", batch, " does not split into ", replicas, " x ",
                                                   microbatches, " micro-batches"));
  }
  const int64_t size = batch / (static_cast<int64_t>(replicas) * microbatches);
  const int z = SizeIndex(profile, size);
  if (z < 0) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batches of ", size, " samples were not measured"));
  }
  const int V = stages_per_worker > 0 ? stages_per_worker : schedule::DefaultStagesPerRank(kind);
  const int S = ranks * V;
  const int n = profile.spans_size();
  if (S > n) {
    return absl::InvalidArgumentError(absl::StrCat(S, " stages, but the model has ", n, " spans to cut between"));
  }
  if (static_cast<int>(workers.size()) < ranks * replicas) {
    return absl::InvalidArgumentError(absl::StrCat(ranks * replicas, " workers needed, ", workers.size(), " given"));
  }
  schedule::ScheduleOptions so;
  so.num_ranks = ranks;
  so.num_microbatches = microbatches;
  so.stages_per_rank = V;
  absl::StatusOr<schedule::Schedule> sched = schedule::MakeSchedule(kind, so);
  if (!sched.ok()) return sched.status();

  std::vector<double> span_cost(n);
  for (int j = 0; j < n; ++j) {
    const SpanSize& s = profile.spans(j).sizes(z);
    span_cost[j] = s.forward_us() + (train ? s.backward_input_us() + s.backward_weight_us() : 0);
  }
  const std::vector<int> starts = MinMaxGroups(span_cost, S);
  std::vector<int> first(S + 1, 0);
  for (int s = 1; s < S; ++s) first[s] = starts[s - 1];
  first[S] = n;

  // Hosts' contention: the threads of the workers used on each host over its cores,
  // and, below that, ranks on one host slowing each other as measured.
  std::map<std::string, int> threads_on_host, ranks_on_host;
  const int used = ranks * replicas;
  for (int g = 0; g < used; ++g) {
    threads_on_host[workers[g].host()] += std::max(1, workers[g].threads());
    ++ranks_on_host[workers[g].host()];
  }
  std::vector<double> slowdown(ranks, 1.0);
  std::vector<int> sharing(ranks, 1);  // the most ranks on the host of rank r, over its replicas
  for (int q = 0; q < replicas; ++q) {
    for (int r = 0; r < ranks; ++r) {
      const WorkerCapacity& w = workers[q * ranks + r];
      double k = 1;
      int together = ranks_on_host[w.host()];
      if (w.host_cpus() > 0) {
        k = std::max(1.0, static_cast<double>(threads_on_host[w.host()]) / w.host_cpus());
        together = std::min(together, w.host_cpus());
      }
      const int measured = profile.colocated_slowdown_size();
      if (together > 1 && measured > 0) k *= profile.colocated_slowdown(std::min(together, measured) - 1);
      slowdown[r] = std::max(slowdown[r], k);
      sharing[r] = std::max(sharing[r], ranks_on_host[w.host()]);
    }
  }
  // What the workers measured in earlier jobs against such predictions, per kind.
  const bool split_backward = kind == SCHEDULE_ZB1P || kind == SCHEDULE_ZBV;

  PlanCandidate c;
  c.set_schedule(kind);
  c.set_microbatches(microbatches);
  c.set_stages(S);
  c.set_stages_per_worker(V);
  c.set_workers(ranks);
  schedule::Costs costs;
  std::vector<int64_t> stage_params(S, 0), stage_buffers(S, 0), stage_act(S, 0);
  const double bw = link.bytes_per_second() > 0 ? link.bytes_per_second() : DefaultLink().bytes_per_second();
  for (int s = 0; s < S; ++s) {
    double f = 0, in = 0, w = 0;
    for (int j = first[s]; j < first[s + 1]; ++j) {
      const SpanSize& x = profile.spans(j).sizes(z);
      f += x.forward_us();
      in += x.backward_input_us();
      w += x.backward_weight_us();
      stage_params[s] += profile.spans(j).param_bytes();
      stage_buffers[s] += profile.spans(j).buffer_bytes();
      stage_act[s] += x.activation_bytes();
    }
    if (s == 0) {
      // The first stage receives no activations: its I has nothing to compute (its
      // spans' I, inside the stage, is part of the backward W runs), as on the ranks.
      w += in;
      in = 0;
    }
    const int rank = sched->stage_to_rank[s];
    const double k = slowdown[rank];
    f *= k;
    in = train ? in * k : 0;
    w = train ? w * k : 0;
    c.add_stage_forward_us(f);
    c.add_stage_input_us(in);
    c.add_stage_weight_us(w);
    if (const ActionFactors* cal = FactorsFor(spec.auto_plan().calibration(), sharing[rank])) {
      auto x = [](double v) { return v > 0 ? v : 1.0; };
      f *= x(cal->forward());
      in *= x(split_backward ? cal->backward_input() : cal->backward());
      w *= x(split_backward ? cal->backward_weight() : cal->backward());
    }
    costs.stage_forward.push_back(f + kActionOverheadUs);
    costs.stage_backward_input.push_back(train ? in + kActionOverheadUs : 0);
    costs.stage_backward_weight.push_back(w);
    c.add_stage_compute_us(f + in + w);
    if (s > 0) c.add_cuts(profile.spans(first[s]).first_node());
    const int64_t bytes_in = s > 0 ? profile.spans(first[s] - 1).sizes(z).cut_bytes() : 0;
    const int64_t bytes_out = s + 1 < S ? profile.spans(first[s + 1] - 1).sizes(z).cut_bytes() : 0;
    costs.stage_recv_forward.push_back(link.latency_us() + 1e6 * static_cast<double>(bytes_in) / bw);
    costs.stage_recv_backward.push_back(link.latency_us() + 1e6 * static_cast<double>(bytes_out) / bw);
  }
  absl::StatusOr<schedule::SimulationResult> sim = schedule::Simulate(*sched, costs);
  if (!sim.ok()) return sim.status();
  double optimizer_us = 0, allreduce_us = 0;
  std::vector<int64_t> memory(ranks, 0);
  const double factor = train ? 2 + StateFactor(spec) : 1;
  for (int r = 0; r < ranks; ++r) {
    int64_t params = 0;
    for (int s : sched->StagesOf(r)) {
      params += stage_params[s];
      const int live = std::max(1, sim->peak_live_per_stage[s]);
      memory[r] += static_cast<int64_t>(factor * static_cast<double>(stage_params[s])) + stage_buffers[s] +
                   live * stage_act[s];
    }
    if (train) {
      optimizer_us = std::max(optimizer_us, profile.optimizer_us_per_mib() * static_cast<double>(params) / (1 << 20));
      if (replicas > 1) allreduce_us = std::max(allreduce_us, 2e6 * static_cast<double>(params) / bw);
    }
  }
  for (int64_t m : memory) c.add_rank_memory_bytes(m);
  const double step_us = sim->makespan + optimizer_us + allreduce_us + kStepOverheadUs;
  c.set_step_seconds(step_us / 1e6);
  c.set_samples_per_second(static_cast<double>(batch) / (step_us / 1e6));
  c.set_bubble_fraction(sim->mean_bubble_fraction);
  // A GPU rank against its device; the CPU ranks of one host together against its memory.
  std::map<std::string, int64_t> host_need, host_free;
  std::map<std::string, int> host_ranks;
  for (int g = 0; g < used; ++g) {
    const int r = g % ranks;
    const WorkerCapacity& w = workers[g];
    if (w.free_memory() <= 0) continue;
    if (w.gpu()) {
      if (memory[r] > w.free_memory() && c.refused().empty()) {
        c.set_refused(absl::StrCat("rank ", r, " needs ", Mib(memory[r]), " (parameters, gradients, optimizer state ",
                                   "and activations) but its GPU has ", Mib(w.free_memory()), " free"));
      }
      continue;
    }
    host_need[w.host()] += memory[r];
    host_free[w.host()] = std::max(host_free[w.host()], w.free_memory());
    ++host_ranks[w.host()];
  }
  for (const auto& [host, need] : host_need) {
    if (need > host_free[host] && c.refused().empty()) {
      c.set_refused(absl::StrCat(host_ranks[host], " rank(s) on ", host, " need ", Mib(need), " (parameters, gradients, ",
                                 "optimizer state and activations) but it has ", Mib(host_free[host]), " free"));
    }
  }
  return c;
}

absl::StatusOr<PlanChoice> ChoosePlan(const JobSpec& spec, const ModelProfile& profile) {
  const AutoPlanSpec& a = spec.auto_plan();
  const int replicas = Replicas(spec);
  const std::vector<WorkerCapacity> workers(a.workers().begin(), a.workers().end());
  const LinkModel link = a.has_link() ? a.link() : DefaultLink();
  PlanChoice choice;
  *choice.mutable_profile() = profile;
  *choice.mutable_link() = link;
  *choice.mutable_workers() = a.workers();
  if (a.schedule()) choice.add_chosen("schedule");
  if (a.microbatches()) choice.add_chosen("microbatches");
  if (a.stages()) choice.add_chosen("stages");
  const int max_ranks = static_cast<int>(workers.size()) / replicas;
  if (a.stages() && max_ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split.stages: auto chooses among the registered workers, and ", workers.size(), " are registered",
        replicas > 1 ? absl::StrCat(" for ", replicas, " replicas") : "", "; start workers or give --stages N"));
  }
  std::vector<int> ms;
  if (a.microbatches()) {
    for (int b : profile.microbatch_sizes()) {
      const int64_t per_replica = spec.batch_size() / replicas;
      if (b > 0 && per_replica % b == 0) ms.push_back(static_cast<int>(per_replica / b));
    }
  } else {
    ms.push_back(spec.schedule().microbatches());
  }
  std::vector<PlanCandidate> all;
  std::string first_error;
  for (ScheduleKind kind : KindsFor(spec)) {
    const int V = StagesPerWorker(spec, kind);
    std::vector<int> rank_options;
    if (a.stages()) {
      // Two stages per worker on one worker parallelise nothing: when the schedule is
      // chosen too, one worker runs one stage.
      for (int r = V > 1 && a.schedule() ? 2 : 1; r <= max_ranks; ++r) rank_options.push_back(r);
    } else if (spec.split().stages() % V == 0) {
      rank_options.push_back(spec.split().stages() / V);
    } else if (first_error.empty()) {
      first_error = absl::StrCat(job::ScheduleName(kind), " holds ", V, " stages per worker, which does not divide ",
                                 spec.split().stages(), " stages");
    }
    for (int R : rank_options) {
      // Without workers to look at (pippyctl plan without --workers), each rank its own host.
      std::vector<WorkerCapacity> use = workers;
      while (static_cast<int>(use.size()) < R * replicas) use.emplace_back().set_host(absl::StrCat("host-", use.size()));
      for (int m : ms) {
        absl::StatusOr<PlanCandidate> c = Predict(spec, profile, kind, m, R, V, use, link);
        if (c.ok()) {
          all.push_back(*std::move(c));
        } else if (first_error.empty()) {
          first_error = std::string(c.status().message());
        }
      }
    }
  }
  if (all.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no plan to choose from: ", first_error));
  }
  std::stable_sort(all.begin(), all.end(), [](const PlanCandidate& x, const PlanCandidate& y) {
    if (x.refused().empty() != y.refused().empty()) return x.refused().empty();
    return x.samples_per_second() > y.samples_per_second();
  });
  if (!all[0].refused().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no plan fits the workers' memory: the fastest, ",
                                                   Describe(all[0]), ", is refused: ", all[0].refused()));
  }
  // A simpler plan close to the fastest: fewer workers, then fewer micro-batches, then
  // the simpler schedule (in KindsFor's order).
  const std::vector<ScheduleKind> kinds = KindsFor(spec);
  auto simplicity = [&kinds](ScheduleKind k) { return std::find(kinds.begin(), kinds.end(), k) - kinds.begin(); };
  size_t win = 0;
  for (size_t i = 1; i < all.size() && all[i].refused().empty(); ++i) {
    if (all[i].samples_per_second() < (1 - kSimplerWithin) * all[0].samples_per_second()) break;
    auto key = [&](const PlanCandidate& c) {
      return std::make_tuple(c.workers(), c.microbatches(), simplicity(c.schedule()));
    };
    if (key(all[i]) < key(all[win])) win = i;
  }
  std::rotate(all.begin(), all.begin() + static_cast<long>(win), all.begin() + static_cast<long>(win) + 1);
  const PlanCandidate& w = all[0];
  std::vector<std::string> lines = {absl::StrFormat("%s: %.1f samples/s predicted (step %.1f ms, bubble %.0f%%)",
                                                    Describe(w), w.samples_per_second(), 1e3 * w.step_seconds(),
                                                    100 * w.bubble_fraction())};
  if (win != 0) {
    lines.push_back(absl::StrFormat("preferred to the fastest, %s (%.1f samples/s), as simpler and within %.0f%%",
                                    Describe(all[1]), all[1].samples_per_second(), 100 * kSimplerWithin));
  }
  // For each dimension chosen, the best plan that differs in it.
  auto best_other = [&](auto differs) -> const PlanCandidate* {
    for (size_t i = 1; i < all.size(); ++i) {
      if (all[i].refused().empty() && differs(all[i])) return &all[i];
    }
    return nullptr;
  };
  const int64_t batch = spec.batch_size();
  if (a.schedule()) {
    if (const PlanCandidate* o = best_other([&](const PlanCandidate& c) { return c.schedule() != w.schedule(); })) {
      lines.push_back("best other schedule, " + Versus(w, *o, batch));
    }
  }
  if (a.microbatches()) {
    if (const PlanCandidate* o =
            best_other([&](const PlanCandidate& c) { return c.microbatches() != w.microbatches(); })) {
      lines.push_back("best other micro-batch count, " + Versus(w, *o, batch));
    }
  }
  if (a.stages()) {
    if (const PlanCandidate* o = best_other([&](const PlanCandidate& c) { return c.workers() != w.workers(); })) {
      lines.push_back("best other worker count, " + Versus(w, *o, batch));
    }
  }
  int refused = 0;
  for (const PlanCandidate& c : all) refused += c.refused().empty() ? 0 : 1;
  if (refused > 0) lines.push_back(absl::StrCat(refused, " candidate(s) refused: over a worker's free memory"));
  for (const std::string& u : profile.unmeasured()) lines.push_back("not a candidate: " + u);
  for (const ActionFactors& f : a.calibration()) {
    lines.push_back(absl::StrCat("ranks on a host of ", f.ranks_on_host(), " or more: costs scaled by what the workers "
                                 "measured in ", f.jobs(), " earlier job(s): ", DescribeFactors(f)));
  }
  choice.set_why(absl::StrJoin(lines, "\n"));
  for (PlanCandidate& c : all) *choice.add_candidates() = std::move(c);
  return choice;
}

void Apply(const PlanCandidate& chosen, JobSpec* spec) {
  ScheduleSpec* s = spec->mutable_schedule();
  s->set_kind(chosen.schedule());
  s->set_microbatches(chosen.microbatches());
  s->set_stages_per_worker(chosen.stages_per_worker());
  spec->mutable_split()->set_stages(chosen.stages());
}

PlanChoice Fallback(const JobSpec& spec, const std::string& why) {
  const AutoPlanSpec& a = spec.auto_plan();
  PlanChoice choice;
  choice.set_fallback(why);
  *choice.mutable_workers() = a.workers();
  PlanCandidate c;
  const bool train = Training(spec);
  const int replicas = Replicas(spec);
  int ranks = a.stages() ? std::max(1, a.workers_size() / replicas) : 0;
  ScheduleKind kind = a.schedule() ? (train ? SCHEDULE_1F1B : SCHEDULE_INFERENCE) : spec.schedule().kind();
  const int V = StagesPerWorker(spec, kind);
  if (!a.stages()) ranks = std::max(1, spec.split().stages() / std::max(1, V));
  int m = spec.schedule().microbatches();
  if (a.microbatches()) {
    const int64_t per_replica = spec.batch_size() / replicas;
    m = 1;
    for (int k = std::min<int64_t>(4, per_replica); k >= 1; --k) {
      if (per_replica % k == 0) {
        m = k;
        break;
      }
    }
    if (train && kind != SCHEDULE_GPIPE && m < ranks) {
      for (int k = ranks; k <= per_replica; ++k) {
        if (per_replica % k == 0) {
          m = k;
          break;
        }
      }
    }
  }
  if (a.schedule() && train && m < ranks) kind = SCHEDULE_GPIPE;
  c.set_schedule(kind);
  c.set_microbatches(m);
  c.set_stages_per_worker(V);
  c.set_workers(ranks);
  c.set_stages(a.stages() ? ranks * V : spec.split().stages());
  if (a.schedule()) choice.add_chosen("schedule");
  if (a.microbatches()) choice.add_chosen("microbatches");
  if (a.stages()) choice.add_chosen("stages");
  choice.set_why(absl::StrCat("the defaults, not measured: ", why));
  *choice.add_candidates() = c;
  return choice;
}

std::string RenderChoice(const PlanChoice& choice, int max_rows) {
  std::string out;
  if (!choice.fallback().empty()) {
    absl::StrAppend(&out, "costs not measured (", choice.fallback(), "): the defaults were used\n");
  }
  absl::StrAppend(&out, absl::StrFormat("%-4s %-17s %-14s %-8s %-8s %12s %7s %-12s %s\n", "#", "schedule",
                                        "micro-batches", "stages", "workers", "samples/s", "bubble", "peak/rank",
                                        "note"));
  int row = 0;
  for (const PlanCandidate& c : choice.candidates()) {
    if (row >= max_rows) {
      absl::StrAppend(&out, "... ", choice.candidates_size() - row, " more\n");
      break;
    }
    int64_t peak = 0;
    for (int64_t m : c.rank_memory_bytes()) peak = std::max(peak, m);
    std::string note = row == 0 ? "chosen" : "";
    if (!c.refused().empty()) note = "refused: " + c.refused();
    const std::string rate = choice.fallback().empty() ? absl::StrFormat("%.1f", c.samples_per_second()) : "-";
    absl::StrAppend(&out, absl::StrFormat("%-4d %-17s %-14d %-8d %-8d %12s %6.0f%% %-12s %s\n", row + 1,
                                          job::ScheduleName(c.schedule()), c.microbatches(), c.stages(), c.workers(),
                                          rate, 100 * c.bubble_fraction(), peak > 0 ? Mib(peak) : "-", note));
    ++row;
  }
  if (!choice.why().empty()) absl::StrAppend(&out, "why: ", choice.why(), "\n");
  return out;
}

std::string RenderProfile(const ModelProfile& p) {
  std::string out = absl::StrFormat("measured on %s with %d thread(s), median of up to %d runs, in %.1f s; optimizer step "
                                    "%.0f us/MiB\n",
                                    p.host(), p.threads(), p.repeats(), p.seconds(), p.optimizer_us_per_mib());
  absl::StrAppend(&out, absl::StrFormat("%-5s %-28s %-28s %10s", "span", "first module", "last module", "params"));
  for (int b : p.microbatch_sizes()) absl::StrAppend(&out, absl::StrFormat("  %26s", absl::StrCat("F/I/W us @", b)));
  absl::StrAppend(&out, "\n");
  for (int j = 0; j < p.spans_size(); ++j) {
    const SpanCost& s = p.spans(j);
    absl::StrAppend(&out, absl::StrFormat("%-5d %-28s %-28s %10s", j, s.first_module().substr(0, 28),
                                          s.last_module().substr(0, 28), Mib(s.param_bytes())));
    for (const SpanSize& z : s.sizes()) {
      absl::StrAppend(&out, absl::StrFormat("  %26s", absl::StrFormat("%.0f/%.0f/%.0f", z.forward_us(),
                                                                      z.backward_input_us(), z.backward_weight_us())));
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace pippy::autoplan
