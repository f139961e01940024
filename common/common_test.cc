#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/device.h"
#include "common/file_writer.h"
#include "common/liveness.h"
#include "common/log.h"
#include "common/memory.h"
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

// The resident memory of this process now (VmRSS), read independently of VmHWM.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

// A step's peak: 64 MiB touched and freed between two readings shows in the second (it
// is above what was resident before by about that much), and not in the third (the
// reading started the peak again).
TEST(Memory, TakePeakResidentBytes_SeesWhatWasTouchedSinceTheLastReading) {
  TakePeakResidentBytes();
  const int64_t before = ResidentBytes();
  ASSERT_GT(before, 0) << "no VmRSS in /proc/self/status";
  constexpr size_t kBytes = 64 << 20;
  {
    std::vector<char> buffer(kBytes, 1);  // touched: resident
    volatile char sink = buffer[kBytes / 2];
    (void)sink;
  }
  const int64_t peak = TakePeakResidentBytes();
  EXPECT_GE(peak, before + static_cast<int64_t>(kBytes) * 9 / 10) << "before " << before;
  const int64_t next = TakePeakResidentBytes();
  EXPECT_LT(next, peak - static_cast<int64_t>(kBytes) / 2) << "the peak did not start again";
}

// A stream appended in uneven pieces across several write-back windows reads back byte
// for byte; reopening truncates; failures name the file.
TEST(FileWriter, WritesAcrossWindows_ReopenTruncates_ErrorsNameTheFile) {
  const std::string path = std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp") + "/fw.bin";
  std::string expected;
  {
    FileWriter w;
    ASSERT_TRUE(w.Open(path).ok());
    uint32_t x = 12345;
    for (size_t piece = 1; expected.size() < 2 * FileWriter::kWindow + 4321; piece = piece * 7 % 3000001 + 1) {
      std::string bytes(piece, '\0');
      for (char& c : bytes) c = static_cast<char>((x = x * 1664525u + 1013904223u) >> 24);
      ASSERT_TRUE(w.Append(bytes).ok());
      expected += bytes;
    }
    EXPECT_EQ(w.bytes(), static_cast<int64_t>(expected.size()));
    ASSERT_TRUE(w.Close().ok());
    EXPECT_FALSE(w.is_open());
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream read;
  read << in.rdbuf();
  EXPECT_TRUE(read.str() == expected) << "read " << read.str().size() << " bytes of " << expected.size();

  FileWriter again;
  ASSERT_TRUE(again.Open(path).ok());
  ASSERT_TRUE(again.Append("short").ok());
  ASSERT_TRUE(again.Close(/*sync=*/false).ok());
  std::ifstream in2(path, std::ios::binary);
  std::string back((std::istreambuf_iterator<char>(in2)), std::istreambuf_iterator<char>());
  EXPECT_EQ(back, "short");

  FileWriter missing;
  const absl::Status open = missing.Open("/nonexistent-dir/x.bin");
  EXPECT_EQ(open.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(open.message().find("/nonexistent-dir/x.bin"), std::string::npos) << open;
  EXPECT_EQ(missing.Append("x").code(), absl::StatusCode::kFailedPrecondition);

  FileWriter full;  // every write to /dev/full fails with ENOSPC
  ASSERT_TRUE(full.Open("/dev/full").ok());
  const absl::Status append = full.Append("x");
  EXPECT_EQ(append.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(append.message().find("/dev/full"), std::string::npos) << append;
}

TEST(Device, ParseResolveAndCheck) {
  EXPECT_EQ(ParseDevice("cpu")->ToString(), "cpu");
  EXPECT_EQ(ParseDevice("cuda")->ToString(), "cuda:0");
  EXPECT_EQ(ParseDevice("cuda:3")->ToString(), "cuda:3");
  EXPECT_EQ(ParseDevice("auto")->ToString(), "auto");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x", "cuda: 1", "CPU", ""}) {
    auto d = ParseDevice(bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("use cpu, cuda, cuda:N"), absl::string_view::npos) << bad;
  }
  // auto: the LOCAL_RANK-th visible GPU (modulo their number), else the CPU.
  const Device a = *ParseDevice("auto");
  EXPECT_EQ(ResolveDevice(a, 0, "3").ToString(), "cpu");
  EXPECT_EQ(ResolveDevice(a, 4, nullptr).ToString(), "cuda:0");
  EXPECT_EQ(ResolveDevice(a, 4, "3").ToString(), "cuda:3");
  EXPECT_EQ(ResolveDevice(a, 2, "3").ToString(), "cuda:1");
  EXPECT_EQ(ResolveDevice(a, 2, "x").ToString(), "cuda:0");
  EXPECT_EQ(ResolveDevice(*ParseDevice("cuda:1"), 0, "0").ToString(), "cuda:1");
  // A CPU-only LibTorch refuses cuda, saying how to build with one; an ordinal beyond
  // the visible GPUs is refused with their number.
  EXPECT_TRUE(CheckDevice(*ParseDevice("cpu"), false, 0).ok());
  absl::Status no_cuda = CheckDevice(*ParseDevice("cuda:0"), false, 0);
  EXPECT_EQ(no_cuda.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_cuda.message().find("this build's LibTorch has no CUDA"), absl::string_view::npos) << no_cuda;
  EXPECT_NE(no_cuda.message().find("use --device cpu"), absl::string_view::npos) << no_cuda;
  EXPECT_TRUE(CheckDevice(*ParseDevice("cuda:1"), true, 2).ok());
  EXPECT_NE(CheckDevice(*ParseDevice("cuda:2"), true, 2).message().find("sees 2 GPU(s)"), absl::string_view::npos);
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

TEST(Liveness, AliveAfterABeat_NotOnceTheLimitPasses) {
  Liveness loop;
  EXPECT_TRUE(loop.Alive(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(60));
  EXPECT_FALSE(loop.Alive(absl::Milliseconds(20)));  // no beat for 60 ms
  EXPECT_GE(loop.SinceBeat(), absl::Milliseconds(60));
  loop.Beat();
  EXPECT_TRUE(loop.Alive(absl::Milliseconds(20)));
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
