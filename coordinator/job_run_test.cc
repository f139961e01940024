// One job's lifecycle (JobRun) without the Coordinator: placement carries each rank its
// piece of the layout, addresses make it RUNNING, complete steps are aggregated,
// a lost worker restarts it from its checkpoint, and a record without its layout is
// not resumed.
#include "coordinator/job_run.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"

namespace pippy::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class Recorder : public WorkerChannel {
 public:
  bool Send(const CoordinatorMessage& m) override {
    sent.push_back(m);
    return true;
  }
  std::vector<CoordinatorMessage> sent;
};

// A 2-stage chain: stage 0 reads the model's input, stage 1 computes the loss.
PipelinePlan TwoStages() {
  PipelinePlan plan;
  plan.add_inputs()->set_name("x");
  for (int s = 0; s < 2; ++s) {
    StagePlan* sp = plan.add_stages();
    sp->set_index(s);
    sp->set_is_last(s == 1);
    sp->set_param_bytes(100);
    StageInput* in = sp->add_inputs();
    if (s == 0) {
      in->set_model_input(0);
      sp->add_outputs()->add_consumers(1);
    } else {
      in->set_source_stage(0);
      in->set_source_output(0);
    }
  }
  return plan;
}

class JobRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/job_run_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    records_ = *JobStore::Open(dir_);
    files_ = *ArtifactStore::Open(dir_);
    job_.set_job_id("job-1");
    JobSpec* spec = job_.mutable_spec();
    spec->mutable_split()->set_stages(2);
    spec->mutable_schedule()->set_kind(SCHEDULE_1F1B);
    spec->mutable_schedule()->set_microbatches(2);
    spec->set_loss(LOSS_MSE);
    spec->mutable_optimizer()->set_kind(OPTIMIZER_SGD);
    spec->mutable_optimizer()->set_lr(0.1);
    spec->set_steps(4);
    spec->set_batch_size(8);
    spec->mutable_fault_tolerance()->set_max_restarts(1);
    ASSERT_TRUE(job::CheckSpec(spec).ok());
    *job_.mutable_plan() = TwoStages();
    layout_ = *job::MakeLayout(job_.spec(), job_.plan());
  }

  std::unique_ptr<JobRun> Accepted() {
    return std::make_unique<JobRun>(JobRun::Stores{records_.get(), files_.get()}, job_, layout_,
                                    std::vector<int64_t>{0, 0}, std::vector<int64_t>{100, 200});
  }

  std::vector<JobRun::PlacedWorker> Workers() {
    return {{"worker-1", "a", Device(), channels_[0]}, {"worker-2", "b", Device(), channels_[1]}};
  }

  StepReport Report(int rank, int step, double seconds, int64_t sent_bytes, int64_t peak_memory = 0) {
    StepReport r;
    r.mutable_breakdown()->set_peak_memory_bytes(peak_memory);
    r.set_job_id("job-1");
    r.set_rank(rank);
    r.set_step(step);
    r.set_step_seconds(seconds);
    r.set_busy_seconds(seconds / 2);
    r.set_lr(0.001 * (step + 1));  // as a schedule's would change
    if (rank == 1) {
      r.set_has_loss(true);
      r.set_loss(3.0);
    }
    TraceEvent* e = r.add_events();
    e->set_kind(rank == 0 ? TRACE_SEND : TRACE_RECV);
    e->set_bytes(sent_bytes);
    TraceEvent* other = r.add_events();
    other->set_kind(TRACE_OTHER);
    other->set_bytes(999);  // not a transfer: not counted
    return r;
  }

  std::string dir_;
  std::unique_ptr<JobStore> records_;
  std::unique_ptr<ArtifactStore> files_;
  Job job_;
  JobLayout layout_;
  std::vector<std::shared_ptr<Recorder>> channels_ = {std::make_shared<Recorder>(), std::make_shared<Recorder>()};
};

TEST_F(JobRunTest, Place_SendsEachRankItsPiece_AddressesMakeItRunning_StepsAreAggregated) {
  auto run = Accepted();
  EXPECT_THAT(run->job().stage_ranks(), ElementsAre(0, 1));
  // Accepted with its stage files written: queued, their sizes in the record.
  EXPECT_EQ(run->state(), QUEUED);
  EXPECT_TRUE(run->StagesOnDisk());
  EXPECT_THAT(run->job().stage_file_bytes(), ElementsAre(100, 200));
  EXPECT_EQ(records_->GetLayout("job-1")->SerializeAsString(), layout_.SerializeAsString());
  std::vector<RankSend> sends = run->Place(Workers());
  ASSERT_EQ(sends.size(), 2u);
  EXPECT_EQ(run->state(), PLACING);
  for (int r = 0; r < 2; ++r) {
    const Assignment& a = sends[r].assignment.assignment();
    EXPECT_EQ(a.rank(), r);
    EXPECT_EQ(a.layout().SerializeAsString(), layout_.ranks(r).SerializeAsString());
    EXPECT_THAT(sends[r].stages, ElementsAre(r));
  }
  ASSERT_EQ(run->job().edges_size(), 1);
  EXPECT_EQ(run->job().edges(0).transport(), "ucx");
  Outbox out;
  for (int r = 0; r < 2; ++r) {
    RankAddress a;
    a.set_job_id("job-1");
    a.set_rank(r);
    a.set_ucx_address(absl::StrCat("addr-", r));
    run->OnAddress(a, &out);
    EXPECT_EQ(out.size(), r == 0 ? 0u : 2u);  // once all are in, each rank gets every address
  }
  EXPECT_EQ(run->state(), RUNNING);
  EXPECT_THAT(out[1].second.peers().ucx_addresses(), ElementsAre("addr-0", "addr-1"));
  EXPECT_FALSE(run->OnStepReport(Report(0, 0, 0.5, 4096)).has_value());
  std::optional<CompletedStep> done = run->OnStepReport(Report(1, 0, 0.75, 4096));
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->seconds, 0.75);
  EXPECT_EQ(done->samples, 8);
  EXPECT_EQ(done->bytes_sent, 4096);
  EXPECT_EQ(done->bytes_received, 4096);
  EXPECT_EQ(run->job().step(), 1);
  EXPECT_THAT(run->job().losses(), ElementsAre(3.0));
  EXPECT_EQ(run->job().breakdown_size(), 2);
  EXPECT_NEAR(run->job().bubble_fraction(), 1.0 - (0.25 + 0.375) / (2 * 0.75), 1e-12);
  // Each rank's memory peak: the step's in the breakdown, the most of any step on the job.
  run->OnStepReport(Report(0, 1, 0.5, 4096, 300 << 20));
  run->OnStepReport(Report(1, 1, 0.5, 4096, 100 << 20));
  run->OnStepReport(Report(0, 2, 0.5, 4096, 200 << 20));
  run->OnStepReport(Report(1, 2, 0.5, 4096, 150 << 20));
  EXPECT_EQ(run->job().breakdown(0).peak_memory_bytes(), 200 << 20);
  EXPECT_THAT(run->job().peak_memory_bytes(), ElementsAre(300 << 20, 150 << 20));
  MetricsSnapshot snapshot;
  snapshot.jobs.push_back(run->View());
  const std::string text = CoordinatorMetrics().Text(snapshot);
  EXPECT_THAT(text, HasSubstr("# TYPE pippy_rank_peak_memory_bytes gauge"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("pippy_rank_peak_memory_bytes{job=\"job-1\",rank=\"0\"} ", 300 << 20)));
  // The learning rate each step's optimizer used, as the ranks reported it: per step in
  // the job, the last in summaries, /metrics and the trace of the last step.
  EXPECT_THAT(run->job().learning_rates(), ElementsAre(0.001, 0.002, 0.003));
  EXPECT_THAT(run->Summary().learning_rates(), ElementsAre(0.003));
  EXPECT_THAT(text, HasSubstr("# TYPE pippy_job_learning_rate gauge"));
  EXPECT_THAT(text, HasSubstr("pippy_job_learning_rate{job=\"job-1\"} 0.003"));
  auto trace = run->Trace(-1, [](int rank) { return absl::StrCat("w", rank); });
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->ranks(1).worker(), "w1");
  EXPECT_EQ(trace->lr(), 0.003);
}

TEST_F(JobRunTest, LostWorker_RestartsOnce_ThenFails_OldAttemptsMessagesAreNotCurrent) {
  auto run = Accepted();
  run->Place(Workers());
  ASSERT_TRUE(run->CanRestart());
  run->Recover("worker w1 lost");
  EXPECT_EQ(run->state(), RECOVERING);
  EXPECT_EQ(run->attempt(), 1);
  EXPECT_FALSE(run->IsCurrent(0));
  EXPECT_FALSE(run->IsCurrent(1)) << "RECOVERING: nothing is current until placed again";
  EXPECT_THAT(run->job().history(run->job().history_size() - 1).message(),
              HasSubstr("worker w1 lost; restarting from step 0 (no checkpoint yet), restart 1 of 1"));
  run->Place(Workers());
  EXPECT_TRUE(run->IsCurrent(1));
  EXPECT_FALSE(run->CanRestart());
  run->Finish(FAILED, "no restart left");
  EXPECT_TRUE(run->ended());
  EXPECT_FALSE(run->IsCurrent(1));
}

// A record whose layout is not in the store (made by an older version, or lost) is not
// resumed on a layout made again: it fails, saying why.
TEST_F(JobRunTest, Restore_WithoutItsLayout_FailsNamingIt) {
  job_.set_state(RUNNING);
  JobRun::Restored restored = JobRun::Restored::kRecovering;
  auto run = JobRun::Restore({records_.get(), files_.get()}, job_, records_->GetLayout("job-1"), &restored);
  EXPECT_EQ(restored, JobRun::Restored::kEnded);
  EXPECT_EQ(run->state(), FAILED);
  EXPECT_THAT(run->job().reason(), HasSubstr("the job's layout is not in its records"));
  EXPECT_THAT(run->job().reason(), HasSubstr("submit it again"));
}

}  // namespace
}  // namespace pippy::coordinator
