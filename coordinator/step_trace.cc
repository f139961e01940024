#include "coordinator/step_trace.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pippy::coordinator {

void StepTraces::Add(int step, std::map<int, StepReport> reports) {
  steps_[step] = std::move(reports);
  while (static_cast<int>(steps_.size()) > kKept) steps_.erase(steps_.begin());
}

absl::StatusOr<StepTrace> StepTraces::Get(const std::string& job_id, int step, bool ran_no_step,
                                          const Names& names) const {
  StepTrace out;
  out.set_job_id(job_id);
  for (const auto& [s, ranks] : steps_) out.add_available_steps(s);
  if (steps_.empty()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no traced step ",
                                            ran_no_step ? "(it ran no step)"
                                                        : "yet (a step is traced once every rank reported it)"));
  }
  auto t = step < 0 ? std::prev(steps_.end()) : steps_.find(step);
  if (t == steps_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, ": step ", step, " is not held; the coordinator keeps ",
                                            "the last ", kKept, " steps: ", absl::StrJoin(out.available_steps(), ", ")));
  }
  out.set_step(t->first);
  if (!t->second.empty()) out.set_lr(t->second.begin()->second.lr());
  for (const auto& [rank, r] : t->second) {
    RankTrace* rt = out.add_ranks();
    rt->set_rank(rank);
    rt->set_worker(names.worker(rank));
    for (int s : names.stages(rank)) rt->add_stages(s);
    rt->set_steady_anchor_us(r.steady_anchor_us());
    rt->set_unix_anchor_us(r.unix_anchor_us());
    *rt->mutable_breakdown() = r.breakdown();
    rt->mutable_breakdown()->set_rank(rank);
    rt->mutable_breakdown()->set_step_seconds(r.step_seconds());
    *rt->mutable_events() = r.events();
  }
  return out;
}

}  // namespace pippy::coordinator
