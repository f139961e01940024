// The parent's half of a child process (child_process.h), with /bin/sh scripts as
// children: how each ending is told apart, which phase it was in, what it said.
#include "coordinator/child_process.h"

#include <atomic>
#include <csignal>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pippy::coordinator {
namespace {

using Ending = ChildResult::Ending;
using ::testing::HasSubstr;

ChildSpec Sh(const std::string& script) {
  ChildSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.timeout = absl::Seconds(20);
  return spec;
}

TEST(ChildProcessTest, Exit_WithPhasesErrorAndPeak_AreParsedApartFromTheRest) {
  ChildResult r = RunChild(Sh("echo '[pippy-phase load]'; echo hello; echo '[pippy-phase split]'; "
                              "echo '[pippy-peak 12345]'; printf '\\n[pippy-error 3]\\nsplit: no cut\\nat all\\n'; "
                              "exit 3"));
  EXPECT_EQ(r.ending, Ending::kExited);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.phase, "split");
  EXPECT_EQ(r.said, "hello");
  EXPECT_EQ(r.peak_rss_bytes, 12345);
  ASSERT_TRUE(r.has_error);
  EXPECT_EQ(r.error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.error.message(), "split: no cut\nat all");
}

TEST(ChildProcessTest, APhaseWithItsOwnLimit_IsStoppedWhenItRunsOut_OtherPhasesAreNot) {
  ChildSpec spec = Sh("echo '[pippy-phase load]'; sleep 0.5; echo '[pippy-phase probe]'; sleep 30");
  spec.phase_timeouts = {{"probe", absl::Milliseconds(300)}, {"load", absl::Milliseconds(300)}};
  const absl::Time start = absl::Now();
  ChildResult r = RunChild(spec);
  // The load phase took 0.5 s, beyond its own 0.3 s: it is stopped there, not in probe.
  EXPECT_EQ(r.ending, Ending::kPhaseTimedOut);
  EXPECT_EQ(r.phase, "load");
  EXPECT_EQ(r.limit, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));

  spec.phase_timeouts = {{"probe", absl::Milliseconds(300)}};
  r = RunChild(spec);
  EXPECT_EQ(r.ending, Ending::kPhaseTimedOut);
  EXPECT_EQ(r.phase, "probe");
}

TEST(ChildProcessTest, TheWholeChild_IsBoundedByItsTimeout) {
  ChildSpec spec = Sh("echo '[pippy-phase write]'; sleep 30");
  spec.timeout = absl::Milliseconds(400);
  ChildResult r = RunChild(spec);
  EXPECT_EQ(r.ending, Ending::kTimedOut);
  EXPECT_EQ(r.limit, absl::Milliseconds(400));
  EXPECT_EQ(r.phase, "write");
}

TEST(ChildProcessTest, Cancelled_KillsTheChild) {
  std::atomic<bool> stop{false};
  ChildSpec spec = Sh("echo '[pippy-phase probe]'; sleep 30");
  spec.cancelled = [&stop] { return stop.load(); };
  std::thread stopper([&stop] {
    absl::SleepFor(absl::Milliseconds(300));
    stop = true;
  });
  const absl::Time start = absl::Now();
  ChildResult r = RunChild(spec);
  stopper.join();
  EXPECT_EQ(r.ending, Ending::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(ChildProcessTest, ASignal_AndABinaryThatIsNotThere_AreTold) {
  ChildResult r = RunChild(Sh("echo '[pippy-phase data]'; kill -SEGV $$"));
  EXPECT_EQ(r.ending, Ending::kSignalled);
  EXPECT_EQ(r.signal, SIGSEGV);
  EXPECT_EQ(r.phase, "data");
  ChildSpec missing;
  missing.argv = {"/nonexistent/pippy-coordinator", "--prepare", "/tmp"};
  r = RunChild(missing);
  EXPECT_EQ(r.ending, Ending::kNotStarted);
  EXPECT_THAT(r.start_error, HasSubstr("/nonexistent/pippy-coordinator"));
}

}  // namespace
}  // namespace pippy::coordinator
