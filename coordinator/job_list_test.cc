// The coordinator as a control plane for many jobs: ListJobs pages (AIP-158) with
// filters and an order, its summaries, DeleteJob, and the retention rule.
#include "coordinator/coordinator_test_fixture.h"

namespace pippy::coordinator {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

class JobListTest : public CoordinatorTest {
 protected:
  // Submits `n` jobs (no workers: they wait QUEUED); their ids in order.
  std::vector<std::string> SubmitMany(int n, const std::string& user = "") {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) {
      auto id = Submit(MlpSpec(2), model_, data_, user);
      EXPECT_TRUE(id.ok()) << id.status();
      if (id.ok()) ids.push_back(*id);
    }
    return ids;
  }

  // Every page of `request` (its page token replaced), `between(page)` run after each.
  std::vector<std::string> AllPages(ListJobsRequest request, const std::function<void(int)>& between = nullptr) {
    std::vector<std::string> ids;
    for (int page = 0; page < 1000; ++page) {
      auto r = coordinator_->ListJobs(request);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) break;
      EXPECT_LE(r->jobs_size(), request.page_size());
      for (const Job& j : r->jobs()) ids.push_back(j.job_id());
      if (between) between(page);
      if (r->next_page_token().empty()) break;
      request.set_page_token(r->next_page_token());
    }
    return ids;
  }

  const std::string model_ = Slurp(kZoo + "mlp.pt");
  const std::string data_ = Slurp(kZoo + "mlp.data.pt");
};

TEST_F(JobListTest, Pages_ListEveryJobExactlyOnce_WhileJobsAreSubmittedAndEnd) {
  Start("pages");
  std::vector<std::string> ids = SubmitMany(10);
  ListJobsRequest req;
  req.set_page_size(3);
  std::vector<std::string> later;
  // Between pages: two more jobs come, one already listed and one not yet listed end.
  std::vector<std::string> listed = AllPages(req, [&](int page) {
    if (page != 1) return;
    later = SubmitMany(2);
    ASSERT_TRUE(coordinator_->CancelJob(ids[1]).ok());
    ASSERT_TRUE(coordinator_->CancelJob(ids[8]).ok());
  });
  std::vector<std::string> want = ids;
  want.insert(want.end(), later.begin(), later.end());
  EXPECT_THAT(listed, ElementsAreArray(want));  // oldest first, each once

  // Newest first: the reverse, in pages of 5.
  req.set_page_size(5);
  req.set_order_by("create_time desc");
  std::vector<std::string> newest(want.rbegin(), want.rend());
  EXPECT_THAT(AllPages(req), ElementsAreArray(newest));

  // A summary: no plan and no loss array, the stage count instead.
  auto first = coordinator_->ListJobs(ListJobsRequest());
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->jobs_size(), 12);
  EXPECT_TRUE(first->next_page_token().empty());
  EXPECT_EQ(first->jobs(0).num_stages(), 2);
  EXPECT_EQ(first->jobs(0).plan().stages_size(), 0);
  EXPECT_EQ(coordinator_->GetJob(ids[0])->plan().stages_size(), 2);
}

TEST_F(JobListTest, Filters_ByStateAndUser_PageOverTheMatchesOnly) {
  Start("filters");
  std::vector<std::string> alice = SubmitMany(3, "alice");
  std::vector<std::string> bob = SubmitMany(4, "bob");
  ASSERT_TRUE(coordinator_->CancelJob(bob[0]).ok());
  ASSERT_TRUE(coordinator_->CancelJob(bob[2]).ok());
  ListJobsRequest req;
  req.set_page_size(1);
  req.add_states(CANCELLED);
  EXPECT_THAT(AllPages(req), ElementsAreArray({bob[0], bob[2]}));
  req.clear_states();
  req.set_user("alice");
  req.set_page_size(2);
  EXPECT_THAT(AllPages(req), ElementsAreArray(alice));
  req.add_states(QUEUED);
  req.set_user("bob");
  EXPECT_THAT(AllPages(req), ElementsAreArray({bob[1], bob[3]}));
}

TEST_F(JobListTest, BadRequests_AreInvalidArgument_NamingTheField) {
  Start("bad_requests");
  SubmitMany(3);
  ListJobsRequest req;
  req.set_page_size(1);
  auto first = coordinator_->ListJobs(req);
  ASSERT_TRUE(first.ok());
  ASSERT_FALSE(first->next_page_token().empty());
  struct Case {
    std::string name;
    std::function<void(ListJobsRequest*)> change;
    std::string want;
  };
  const std::string token = first->next_page_token();
  const std::vector<Case> cases = {
      {"garbage token", [](ListJobsRequest* r) { r->set_page_token("not-a-token!"); }, "page_token:"},
      {"token of other filters", [&](ListJobsRequest* r) { r->set_page_token(token); r->add_states(RUNNING); },
       "page_token:"},
      {"token of another order", [&](ListJobsRequest* r) { r->set_page_token(token); r->set_order_by("create_time desc"); },
       "page_token:"},
      {"token edited", [&](ListJobsRequest* r) { r->set_page_token(token.substr(0, token.size() - 2)); }, "page_token:"},
      {"negative page size", [](ListJobsRequest* r) { r->set_page_size(-1); }, "page_size:"},
      {"unknown order", [](ListJobsRequest* r) { r->set_order_by("name"); }, "order_by:"},
      {"unknown state", [](ListJobsRequest* r) { r->add_states(static_cast<JobState>(77)); }, "states:"},
  };
  for (const Case& c : cases) {
    ListJobsRequest r = req;
    c.change(&r);
    auto got = coordinator_->ListJobs(r);
    ASSERT_FALSE(got.ok()) << c.name;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.want)) << c.name;
  }
  // The same token, with the same request, goes on.
  req.set_page_token(token);
  EXPECT_TRUE(coordinator_->ListJobs(req).ok());
}

TEST_F(JobListTest, Delete_RemovesAnEndedJobsRecordAndFiles_NotARunningOne) {
  Start("delete");
  std::vector<std::string> ids = SubmitMany(2, "alice");
  const std::string dir0 = state_ + "/jobs/" + ids[0];
  ASSERT_TRUE(std::filesystem::exists(dir0));
  EXPECT_EQ(coordinator_->DeleteJob(ids[0]).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(coordinator_->CancelJob(ids[0]).ok());
  EXPECT_EQ(coordinator_->DeleteJob(ids[0], "bob").code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(coordinator_->DeleteJob(ids[0], "alice").ok());
  EXPECT_EQ(coordinator_->GetJob(ids[0]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->DeleteJob(ids[0]).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(dir0));
  EXPECT_TRUE(std::filesystem::exists(state_ + "/jobs/" + ids[1]));
  // Gone from the records too: a restarted coordinator does not know it.
  coordinator_.reset();
  Start("delete", 1 << 20, /*keep_state=*/true);
  EXPECT_EQ(coordinator_->GetJob(ids[0]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(coordinator_->GetJob(ids[1]).ok());
}

TEST_F(JobListTest, Retention_DeletesTheLongestEndedJobsFiles_AndNothingElse) {
  max_finished_jobs_ = 1;
  Start("retention");
  std::vector<std::string> ids = SubmitMany(4);
  const std::string stray = state_ + "/jobs/not-a-job.txt";
  std::ofstream(stray) << "not pippy's";
  // An ended job keeps its published result (what FetchModel serves) until deleted;
  // the jobs' own folders go when they end.
  auto published = [&](const std::string& id) { return state_ + "/models/" + id + ".pt"; };
  for (const std::string& id : ids) std::ofstream(published(id)) << "a trained model";
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(coordinator_->CancelJob(ids[i]).ok());
    absl::SleepFor(absl::Milliseconds(5));  // distinct end times
  }
  // The loop applies the rule once a second: only the last one to end stays of the ended.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (coordinator_->ListJobs(ListJobsRequest())->jobs_size() != 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  std::vector<std::string> left;
  auto page = coordinator_->ListJobs(ListJobsRequest());
  ASSERT_TRUE(page.ok()) << page.status();
  for (const Job& j : page->jobs()) left.push_back(j.job_id());
  EXPECT_THAT(left, ElementsAreArray({ids[2], ids[3]}));
  // The dropped jobs' files go (after the lock is released: waited for), the rest stay.
  for (int i = 0; i < 2; ++i) {
    for (int tries = 0; tries < 100 && std::filesystem::exists(published(ids[i])); ++tries) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_FALSE(std::filesystem::exists(published(ids[i]))) << ids[i];
  }
  EXPECT_TRUE(std::filesystem::exists(published(ids[2])));
  EXPECT_TRUE(std::filesystem::exists(published(ids[3])));
  EXPECT_TRUE(std::filesystem::exists(state_ + "/jobs/" + ids[3] + "/stage_0.pt"));
  EXPECT_TRUE(std::filesystem::exists(stray));
}

}  // namespace
}  // namespace pippy::coordinator
