#include <stdexcept>

#include "common/log.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "gtest/gtest.h"

namespace pippy {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status Quarter(int x, int* out) {
  PIPPY_ASSIGN_OR_RETURN(int h, Half(x));
  PIPPY_ASSIGN_OR_RETURN(*out, Half(h));
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturn_PropagatesFirstError) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  EXPECT_EQ(Quarter(6, &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TorchCall, C10Error_BecomesStatusWithContextAndNoBacktrace) {
  absl::StatusOr<int> r = TorchCall("loading m.pt", []() -> int {
    TORCH_CHECK(false, "expected a zip archive");
    return 1;
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "loading m.pt: expected a zip archive");
}

TEST(TorchCall, StdException_BecomesStatus) {
  absl::Status s = TorchCall("x", [] { throw std::runtime_error("boom"); });
  EXPECT_EQ(s.message(), "x: boom");
}

TEST(TorchCall, Value_PassesThrough) {
  absl::StatusOr<int> r = TorchCall("x", [] { return 7; });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 7);
}

TEST(Log, ParseLevel_RejectsUnknownWithHint) {
  log::Level level;
  EXPECT_TRUE(log::ParseLevel("debug", &level).ok());
  absl::Status s = log::ParseLevel("loud", &level);
  EXPECT_NE(s.message().find("use debug, info"), std::string::npos);
  log::Init("common_test", log::Level::kInfo);
  log::Info("job={} stage={} mb={} started", "j1", 0, 3);
}

}  // namespace
TEST(Metrics, Exposition_FamiliesEscapedLabelsHistogram) {
  metrics::Exposition e;
  e.Family("pippy_jobs", "gauge", "Jobs by state");
  e.Sample("pippy_jobs", {{"state", "RUNNING"}}, 2);
  e.Sample("pippy_jobs", {{"name", "a\"b\\c\nd"}}, 0.25);
  metrics::Histogram h({0.1, 1});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(7);
  e.Family("pippy_step_seconds", "histogram", "Step time");
  e.HistogramSamples("pippy_step_seconds", {}, h);
  EXPECT_EQ(e.text(),
            "# HELP pippy_jobs Jobs by state\n# TYPE pippy_jobs gauge\n"
            "pippy_jobs{state=\"RUNNING\"} 2\n"
            "pippy_jobs{name=\"a\\\"b\\\\c\\nd\"} 0.25\n"
            "# HELP pippy_step_seconds Step time\n# TYPE pippy_step_seconds histogram\n"
            "pippy_step_seconds_bucket{le=\"0.1\"} 1\n"
            "pippy_step_seconds_bucket{le=\"1\"} 2\n"
            "pippy_step_seconds_bucket{le=\"+Inf\"} 3\n"
            "pippy_step_seconds_sum 7.55\n"
            "pippy_step_seconds_count 3\n");
}

}  // namespace pippy
