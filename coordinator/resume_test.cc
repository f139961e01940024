// CheckResume (resume.h): what a job resuming another's checkpoint must share with it,
// on records made here (the e2e dataset_test resumes real jobs).
#include "coordinator/resume.h"

#include <gtest/gtest.h>

namespace pippy::coordinator {
namespace {

// A 2-stage plan, stage s holding "blocks.s.weight" of `shape`; 2 ranks, one stage each.
void MakeJob(Job* job, JobLayout* layout, int64_t rows = 4) {
  job->Clear();
  job->set_job_id("job-1");
  job->set_user("alice");
  job->set_state(SUCCEEDED);
  job->set_checkpoint_step(20);
  JobSpec* spec = job->mutable_spec();
  spec->set_mode(MODE_TRAIN);
  spec->set_steps(20);
  spec->mutable_optimizer()->set_kind(OPTIMIZER_ADAMW);
  for (int s = 0; s < 2; ++s) {
    ParameterInfo* p = job->mutable_plan()->add_stages()->add_parameters();
    p->set_name("blocks." + std::to_string(s) + ".weight");
    p->add_shape(rows);
    p->add_shape(8);
  }
  layout->clear_ranks();
  for (int r = 0; r < 2; ++r) {
    RankLayout* piece = layout->add_ranks();
    piece->set_num_ranks(2);
    piece->add_stage_to_rank(0);
    piece->add_stage_to_rank(1);
  }
}

class ResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeJob(&source_, &source_layout_);
    MakeJob(&next_, &layout_);
    next_.mutable_spec()->set_steps(30);
    next_.mutable_spec()->set_resume_from("job-1");
  }
  absl::Status Check(const std::string& user = "alice") {
    return CheckResume(source_, source_layout_, user, next_.spec(), next_.plan(), layout_);
  }
  Job source_, next_;
  JobLayout source_layout_, layout_;
};

TEST_F(ResumeTest, SameJobWithMoreStepsResumes) { EXPECT_TRUE(Check().ok()) << Check(); }

TEST_F(ResumeTest, StepsCountTheWholeRun) {
  next_.mutable_spec()->set_steps(20);
  const absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("checkpoint is after step 20 and this job has 20 steps"), std::string::npos) << s;
}

TEST_F(ResumeTest, ANoCheckpointJobIsRefused) {
  source_.set_checkpoint_step(0);
  source_.set_state(FAILED);
  const absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("job-1 (FAILED, step 0) has no checkpoint"), std::string::npos) << s;
}

TEST_F(ResumeTest, AnotherUsersJobIsRefused) {
  EXPECT_EQ(Check("bob").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Check("").ok());  // no auth: no users
}

TEST_F(ResumeTest, AParameterOfAnotherShapeIsNamed) {
  MakeJob(&next_, &layout_, /*rows=*/5);
  next_.mutable_spec()->set_steps(30);
  const absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("stage 0's 'blocks.0.weight' is [4, 8] there and [5, 8] here"), std::string::npos) << s;
}

TEST_F(ResumeTest, AMissingParameterIsNamed) {
  next_.mutable_plan()->mutable_stages(1)->mutable_parameters(0)->set_name("blocks.1.bias");
  const absl::Status s = Check();
  EXPECT_NE(s.message().find("stage 1 has no 'blocks.1.bias' there"), std::string::npos) << s;
}

TEST_F(ResumeTest, OtherOptimizerReplicasOrPlacementAreRefused) {
  next_.mutable_spec()->mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  EXPECT_NE(Check().message().find("its optimizer is adamw, this job's sgd"), std::string::npos) << Check();
  next_.mutable_spec()->mutable_optimizer()->set_kind(OPTIMIZER_ADAMW);
  next_.mutable_spec()->set_replicas(2);
  EXPECT_NE(Check().message().find("it ran 1 replica(s), this job 2"), std::string::npos) << Check();
  next_.mutable_spec()->set_replicas(1);
  for (RankLayout& piece : *layout_.mutable_ranks()) piece.set_stage_to_rank(1, 0);
  EXPECT_NE(Check().message().find("rank 0 ran stages 0 there and 0,1 here"), std::string::npos) << Check();
}

TEST_F(ResumeTest, OnlyTrainingJobsResume) {
  source_.mutable_spec()->set_mode(MODE_INFERENCE);
  EXPECT_EQ(Check().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pippy::coordinator
