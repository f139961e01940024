// Loading and writing TorchScript archives: every way a file can be wrong gets
// INVALID_ARGUMENT (or NOT_FOUND) naming the file and saying how to make a good one.
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::torchio {
namespace {

using testing::AllOf;
using testing::HasSubstr;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

std::string WriteTemp(const std::string& name, const std::string& bytes) {
  std::string path = std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string Prefix(const std::string& path, size_t n) {
  auto bytes = ReadFile(path);
  EXPECT_TRUE(bytes.ok());
  return bytes->substr(0, std::min(n, bytes->size()));
}

// A sink that fails part way (a cancelled job's stage sender) ends the write with its
// error; LibTorch's writer must not be left to throw from its destructor (that was a
// std::terminate in the coordinator).
TEST(WriteModule, SinkFailingPartWay_ReturnsItsError) {
  auto m = LoadModel(Zoo("gpt.pt"));
  ASSERT_TRUE(m.ok()) << m.status();
  int calls = 0;
  absl::Status s = WriteModule(*m, [&](absl::string_view) {
    return ++calls < 3 ? absl::OkStatus() : absl::CancelledError("the job was cancelled");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(calls, 3);  // nothing more reached the sink after it failed
}

TEST(LoadModel, MissingFile_NotFoundNamingPath) {
  auto m = LoadModel("no/such/model.pt");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("no/such/model.pt"));
}

TEST(LoadModel, NotAZipFile_SaysHowToSave) {
  auto m = LoadModel(WriteTemp("text.pt", "hello, not a model\n"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(),
              AllOf(HasSubstr("not a TorchScript archive"), HasSubstr("torch.jit.script(model).save")));
}

TEST(LoadModel, EmptyFile_Rejected) {
  auto m = LoadModel(WriteTemp("empty.pt", ""));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("is empty"));
}

TEST(LoadModel, TruncatedArchive_SaysTruncated) {
  auto m = LoadModel(WriteTemp("trunc.pt", Prefix(Zoo("gpt.pt"), 4000)));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("truncated or corrupt"));
}

TEST(LoadModel, TorchSaveCheckpoint_SaysItIsNotTorchScript) {
  auto m = LoadModel(Zoo("mlp.checkpoint.pt"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("looks like a torch.save() checkpoint"));
}

}  // namespace
}  // namespace pippy::torchio
