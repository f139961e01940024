// ScanPickle and PickleLoadUntrusted on serving requests made by Python's torch.save
// (fuzz/corpus/request_fuzz, fuzz/make_seeds.py): every good one loads; every hostile
// one is INVALID_ARGUMENT saying what it found, before LibTorch's unpickler runs.
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/torchio/pickle_scan.h"

namespace pippy::torchio {
namespace {

using ::testing::HasSubstr;

std::string Seed(const std::string& name) {
  std::ifstream in("fuzz/corpus/request_fuzz/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << name;
  return ss.str();
}

// Tensors in `v`, through tuples and lists.
size_t CountTensors(const c10::IValue& v) {
  size_t n = v.isTensor() ? 1 : 0;
  if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) n += CountTensors(e);
  }
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) n += CountTensors(e);
  }
  return n;
}

TEST(PickleLoadUntrusted, RequestsTorchSaveWrites_Load) {
  for (const char* name : {"tensor.pt", "tuple.pt", "list.pt", "dict.pt", "datafile.pt", "scalars.pt", "int64.pt"}) {
    auto v = PickleLoadUntrusted(Seed(name), "input");
    ASSERT_TRUE(v.ok()) << name << ": " << v.status();
    // The same value as the trusted loader reads.
    auto trusted = PickleLoad(Seed(name), "input");
    ASSERT_TRUE(trusted.ok());
    EXPECT_EQ(CountTensors(*v), CountTensors(*trusted)) << name;
  }
}

// LibTorch 1.13's unpickler lacks APPEND and SETITEM, which Python writes for a list or
// dict of one item: both loaders rewrite them (torch.save({"inputs": x}) is a data file).
TEST(PickleLoad, SingleItemListAndDict_Load) {
  for (const char* name : {"one-item-list.pt", "one-item-dict.pt", "datafile.pt"}) {
    for (bool untrusted : {false, true}) {
      auto v = untrusted ? PickleLoadUntrusted(Seed(name), "input") : PickleLoad(Seed(name), "input");
      ASSERT_TRUE(v.ok()) << name << ": " << v.status();
      if (v->isGenericDict()) {
        ASSERT_EQ(v->toGenericDict().size(), 1u) << name;
        EXPECT_TRUE(v->toGenericDict().begin()->value().isTensor()) << name;
      } else {
        EXPECT_EQ(CountTensors(*v), 1u) << name;
      }
    }
  }
  auto list = PickleLoad(Seed("one-item-list.pt"), "input");
  ASSERT_TRUE(list->isList());
  EXPECT_EQ(list->toList().size(), 1u);
}

TEST(PickleLoadUntrusted, HostileRequests_RefusedNamingWhatWasFound) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"oom-pickle-string-length", "announces 4026531840 bytes but only"},
      {"type-tag", "names 'torch.jit._pickle.restore_type_tag'"},
      {"global-os-system", "names 'os.system'"},
      {"cycle-list-holds-itself", "the same list, dict or object twice"},
      {"same-tensor-twice", "the same list, dict or object twice"},
      {"deep-nesting-100", "nest more than 32 levels"},
      {"truncated-pickle", "without its STOP"},
      {"oom-memo-index", "skips past the"},
      {"record-claims-4gib", "input"},
  };
  for (const auto& [name, expect] : cases) {
    auto v = PickleLoadUntrusted(Seed(name), "input");
    ASSERT_FALSE(v.ok()) << name;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(v.status().message()), HasSubstr(expect)) << name;
  }
  EXPECT_THAT(std::string(PickleLoadUntrusted("not a zip", "input").status().message()),
              HasSubstr("input: not a torch.save file"));
}

TEST(ScanPickle, Limits) {
  // A list nested 3 deep passes a depth of 4 and fails a depth of 2.
  const std::string nested("\x80\x02]]]NaaaN\x30.", 12);
  EXPECT_TRUE(ScanPickle(nested, "p", {1024, 4}).ok()) << ScanPickle(nested, "p", {1024, 4});
  EXPECT_THAT(std::string(ScanPickle(nested, "p", {1024, 2}).message()), HasSubstr("nest more than 2"));
  EXPECT_THAT(std::string(ScanPickle(std::string(2000, 'N'), "p", {1024, 4}).message()), HasSubstr("at most 1024"));
  // An opcode that takes a value with none on the stack; a memo entry never stored.
  EXPECT_THAT(std::string(ScanPickle("\x80\x02\x85.", "p").message()), HasSubstr("takes a value"));
  EXPECT_THAT(std::string(ScanPickle("\x80\x02h\x05.", "p").message()), HasSubstr("never stored"));
  EXPECT_THAT(std::string(ScanPickle("\x80\x02NN.", "p").message()), HasSubstr("exactly one value"));
}

}  // namespace
}  // namespace pippy::torchio
