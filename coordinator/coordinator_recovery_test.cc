// The coordinator's fault tolerance with fake worker channels: a lost worker fails or
// restarts its job from the last checkpoint, and a restarted coordinator resumes the
// jobs it had from its state directory.
#include "coordinator/artifact_store.h"
#include "coordinator/coordinator_test_fixture.h"

namespace pippy::coordinator {
namespace {

using ::testing::HasSubstr;

TEST_F(CoordinatorTest, WorkerLost_WithoutRestarts_FailsTheJobNamingIt_AndTellsTheOthersToStop) {
  Start("worker_lost");
  auto workers = AddWorkers(2);
  JobSpec spec = MlpSpec(2);
  spec.mutable_fault_tolerance()->set_max_restarts(0);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok());
  for (int r = 0; r < 2; ++r) workers[r]->WaitFor(AssignmentArrived);
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  Job job = *coordinator_->GetJob(*id);
  EXPECT_EQ(job.state(), FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker w1"));
  EXPECT_THAT(job.reason(), HasSubstr("stages 1"));
  EXPECT_THAT(job.reason(), HasSubstr("no restart left (0 of 0 used; raise it with --max-restarts)"));
  auto msgs = workers[0]->WaitFor(CancelArrived);
  EXPECT_TRUE(CancelArrived(msgs));
  // The survivor is busy until it reports back, then idle.
  FinishRank(ids_[0], Collect(msgs).assignment, false, "cancelled");
  auto listed = coordinator_->ListWorkers();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].state(), IDLE);
}

// Checkpoints after steps 1 and 2 are committed (files on disk, the record names the
// step, the older one removed); a lost worker sends the job to RECOVERING, and it is
// placed again (attempt 1) on the survivor and the spare from the checkpoint: the
// checkpoint's stages, each rank's state, the start step. The stopped attempt's
// messages change nothing.
TEST_F(CoordinatorTest, WorkerLost_JobRestartsFromItsLastCheckpointOnTheSpare) {
  Start("restart_from_checkpoint", /*chunk_bytes=*/4096);
  auto workers = AddWorkers(3);
  JobSpec spec = MlpSpec(2);
  spec.set_steps(5);
  spec.mutable_fault_tolerance()->set_checkpoint_every(1);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  // Workers 0 and 1 (ids order) hold ranks 0 and 1; worker 2 is the spare.
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  WaitForJob(*id, [this, &id](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/stage_1.pt"));
  });
  // Trained stages differ from the originals: the checkpoint's are recognisable.
  for (auto& g : got) {
    for (auto& [s, bytes] : g.stages) bytes += "-trained";
  }
  for (int r = 0; r < 2; ++r) PlaySteps(ids_[r], got[r], 0, 0);  // addresses: RUNNING
  for (int r = 0; r < 2; ++r) PlaySteps(ids_[r], got[r], 0, 2, /*checkpoint_every=*/1);
  Job running = WaitForJob(*id, [](const Job& j) { return j.checkpoint_step() == 2; });
  ASSERT_EQ(running.checkpoint_step(), 2);
  ASSERT_EQ(running.state(), RUNNING);
  const std::string ckpt = absl::StrCat(state_, "/jobs/", *id, "/checkpoint-2");
  EXPECT_EQ(Slurp(ckpt + "/rank_1.state"), "state-1-2");
  EXPECT_EQ(Slurp(ckpt + "/stage_0.pt"), got[0].stages.at(0));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/checkpoint-1")));
  // Half of a checkpoint after step 3 (rank 0 only), then rank 1's worker is lost.
  PlaySteps(ids_[0], got[0], 2, 3);
  SendCheckpoint(ids_[0], got[0], 3);
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  Job recovering = *coordinator_->GetJob(*id);
  EXPECT_EQ(recovering.state(), RECOVERING);
  EXPECT_EQ(recovering.restarts(), 1);
  EXPECT_EQ(recovering.attempt(), 1);
  EXPECT_EQ(recovering.step(), 2);
  EXPECT_EQ(recovering.losses_size(), 2);
  ASSERT_GT(recovering.history_size(), 0);
  EXPECT_THAT(recovering.history(recovering.history_size() - 1).message(),
              HasSubstr("worker w1 (" + ids_[1] + ", rank 1, stages 1) disconnected (test); restarting from step 2"));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/checkpoint-3")));
  // The survivor is told to stop; until it reports back the job waits (the spare alone
  // is not enough).
  auto msgs = workers[0]->WaitFor(CancelArrived);
  ASSERT_TRUE(CancelArrived(msgs));
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), RECOVERING);
  // A late report of the stopped attempt changes nothing.
  WorkerMessage late;
  late.mutable_step()->set_job_id(*id);
  late.mutable_step()->set_rank(0);
  late.mutable_step()->set_step(3);
  late.mutable_step()->set_attempt(0);
  coordinator_->OnWorkerMessage(ids_[0], late);
  EXPECT_EQ(coordinator_->GetJob(*id)->step(), 2);
  FinishRank(ids_[0], got[0].assignment, false, "cancelled");
  // Placed again: ranks on the survivor (w0) and the spare (w2), from the checkpoint.
  std::vector<Received> again;
  for (int w : {0, 2}) again.push_back(Collect(workers[w]->WaitFor(AttemptArrived(1))));
  for (const Received& r : again) {
    ASSERT_TRUE(r.complete);
    const int rank = r.assignment.rank();
    EXPECT_EQ(r.assignment.start_step(), 2);
    EXPECT_EQ(r.state, absl::StrCat("state-", rank, "-2"));
    EXPECT_EQ(r.stages.at(rank), got[rank].stages.at(rank));
  }
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
  // The new attempt runs to the end and the result is assembled from its stages.
  for (const Received& r : again) {
    Received original = r;
    for (auto& [s, bytes] : original.stages) bytes = got[s].stages.at(s).substr(0, bytes.size() - 8);  // loadable
    PlayRank(r.assignment.rank() == 0 ? ids_[0] : ids_[2], original, 5);
  }
  for (const Received& r : again) FinishRank(r.assignment.rank() == 0 ? ids_[0] : ids_[2], r.assignment, true);
  Job done = WaitForState(*id, SUCCEEDED);
  EXPECT_EQ(done.state(), SUCCEEDED) << done.reason();
  EXPECT_EQ(done.step(), 5);
  EXPECT_EQ(done.losses_size(), 5);
}

TEST_F(CoordinatorTest, WorkerLost_NoWorkersWithinTheRecoveryTimeout_FailsSayingSo) {
  Start("recovery_timeout");
  auto workers = AddWorkers(2);
  JobSpec spec = MlpSpec(2);
  spec.mutable_fault_tolerance()->set_recovery_timeout_s(0.3);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok());
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  WaitForJob(*id, [this, &id](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/stage_1.pt"));
  });
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), RECOVERING);
  FinishRank(ids_[0], got[0].assignment, false, "cancelled");
  Job failed = WaitForState(*id, FAILED);
  EXPECT_EQ(failed.state(), FAILED);
  EXPECT_THAT(failed.reason(), HasSubstr("(--recovery-timeout-s) for 2 idle workers to restart the job from step 0; "
                                         "1 of 1 registered workers are idle"));
}

// After a restart with the same state directory: finished jobs stay fetchable, a job
// that was placed resumes (RECOVERING) once its workers reconnect, and they keep their
// ids.
TEST_F(CoordinatorTest, Restart_ResumesPlacedJobs_WorkersKeepTheirIds_FinishedOnesStayFetchable) {
  Start("restart");
  auto workers = AddWorkers(2);
  auto finished = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(finished.ok());
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  for (int r = 0; r < 2; ++r) PlayRank(ids_[r], got[r], 2);
  for (int r = 0; r < 2; ++r) FinishRank(ids_[r], got[r].assignment, true);
  ASSERT_EQ(WaitForState(*finished, SUCCEEDED).state(), SUCCEEDED);
  auto unfinished = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(unfinished.ok());
  WaitForJob(*unfinished, [this, &unfinished](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *unfinished, "/stage_1.pt"));
  });
  const std::vector<std::string> old_ids = ids_;
  coordinator_.reset();
  ids_.clear();
  Start("restart", 1 << 20, /*keep_state=*/true);
  EXPECT_EQ(coordinator_->GetJob(*finished)->state(), SUCCEEDED);
  EXPECT_TRUE(coordinator_->ResultPath(*finished).ok());
  auto again = coordinator_->GetJob(*unfinished);
  EXPECT_EQ(again->state(), RECOVERING);
  EXPECT_EQ(again->attempt(), 1);
  ASSERT_GT(again->history_size(), 0);
  EXPECT_THAT(again->history(again->history_size() - 1).message(),
              HasSubstr("the coordinator restarted while the job was PLACING; resuming from step 0"));
  // The workers reconnect (in the other order) under their old ids; a new one gets a new id.
  auto back = AddWorkers(2, {old_ids[1], old_ids[0]});
  EXPECT_EQ(ids_[0], old_ids[1]);
  EXPECT_EQ(ids_[1], old_ids[0]);
  auto fresh = AddWorkers(1);
  EXPECT_NE(ids_[2], old_ids[0]);
  EXPECT_NE(ids_[2], old_ids[1]);
  // The job is placed again, on the two idle workers first registered, from its stage
  // files and step 0.
  // Each rank's piece is the layout the job was prepared with, read back from the
  // state directory (here compared with one made again from the job's spec and plan).
  JobSpec spec = again->spec();
  auto layout = job::MakeLayout(spec, again->plan());
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (auto& w : back) {
    Received r = Collect(w->WaitFor(AttemptArrived(1)));
    ASSERT_TRUE(r.complete);
    EXPECT_EQ(r.assignment.layout().SerializeAsString(), layout->ranks(r.assignment.rank()).SerializeAsString());
    EXPECT_EQ(r.assignment.start_step(), 0);
    EXPECT_EQ(r.assignment.state_bytes(), 0);
    EXPECT_EQ(r.stages.at(r.assignment.rank()), got[r.assignment.rank()].stages.at(r.assignment.rank()));
  }
  EXPECT_FALSE(Collect(fresh[0]->messages()).complete);
  EXPECT_EQ(coordinator_->GetJob(*unfinished)->state(), PLACING);
}

// A queued job (no workers yet) is queued again after a restart and placed from its
// stage files when workers come.
TEST_F(CoordinatorTest, Restart_KeepsQueuedJobsQueued) {
  auto id = QueueMlpAndStop("restart_queued");
  ASSERT_TRUE(id.ok()) << id.status();
  Start("restart_queued", 1 << 20, /*keep_state=*/true);
  Job again = *coordinator_->GetJob(*id);
  EXPECT_EQ(again.state(), QUEUED);
  auto workers = AddWorkers(2);
  for (auto& w : workers) {
    Received r = Collect(w->WaitFor(AssignmentArrived));
    ASSERT_TRUE(r.complete);
    EXPECT_EQ(r.assignment.attempt(), 0);
    EXPECT_EQ(r.stages.at(r.assignment.rank()),
              Slurp(absl::StrCat(state_, "/jobs/", *id, "/stage_", r.assignment.rank(), ".pt")));
  }
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
}

// Uploaded datasets no job names (a submission cut off by the restart) are removed at
// start-up.
TEST_F(CoordinatorTest, Restart_RemovesUploadedDatasetsNoJobNames) {
  auto id = QueueMlpAndStop("restart_datasets");
  ASSERT_TRUE(id.ok()) << id.status();
  const std::filesystem::path datasets = std::filesystem::absolute(state_ + "/datasets");
  for (const char* dir : {"4242-1", "4242-2"}) {
    std::filesystem::create_directories(datasets / dir);
    std::ofstream(datasets / dir / "00000000_part.bin") << "abcd";
  }
  Start("restart_datasets", 1 << 20, /*keep_state=*/true);
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), QUEUED);
  EXPECT_FALSE(std::filesystem::exists(datasets / "4242-1"));
  EXPECT_FALSE(std::filesystem::exists(datasets / "4242-2"));
}

// The sweep keeps the folders it is told are in use (a job's spec names them), and
// touches nothing outside datasets/.
TEST(ArtifactStoreTest, RemoveUploadedDatasetsExcept_KeepsTheNamedOnes) {
  const std::string state = TmpDir("artifact_datasets");
  auto store = ArtifactStore::Open(state);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::filesystem::path datasets = (*store)->DatasetsDir();
  for (const char* dir : {"1-1", "1-2", "1-3"}) {
    std::filesystem::create_directories(datasets / dir);
    std::ofstream(datasets / dir / "00000000_part.bin") << "abcd";
  }
  std::ofstream(std::filesystem::path(state) / "keep.txt") << "x";
  EXPECT_EQ((*store)->RemoveUploadedDatasetsExcept({(datasets / "1-2").string()}), 2);
  EXPECT_FALSE(std::filesystem::exists(datasets / "1-1"));
  EXPECT_TRUE(std::filesystem::exists(datasets / "1-2" / "00000000_part.bin"));
  EXPECT_FALSE(std::filesystem::exists(datasets / "1-3"));
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(state) / "keep.txt"));
  EXPECT_EQ((*store)->RemoveUploadedDatasetsExcept({(datasets / "1-2").string()}), 0);
}

}  // namespace
}  // namespace pippy::coordinator
