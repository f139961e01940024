#include <stdexcept>

#include "common/log.h"
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
}  // namespace pippy
