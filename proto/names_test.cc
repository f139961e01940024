#include "proto/names.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/job_state.h"

namespace pippy::names {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> NamesOf(const std::vector<Choice>& choices) {
  std::vector<std::string> out;
  for (const Choice& c : choices) out.push_back(c.name);
  return out;
}

TEST(Names, Schedules_InDeclarationOrder_EachWithHelp) {
  EXPECT_THAT(NamesOf(Choices<ScheduleKind>()),
              ElementsAre("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb1p", "zbv", "inference"));
  for (const Choice& c : Choices<ScheduleKind>()) EXPECT_FALSE(c.help.empty()) << c.name;
}

// Every value but UNSPECIFIED of the spec's enums is in the table: a value added to a
// .proto without a name would be one users cannot choose.
template <typename E>
void ExpectEveryValueNamed() {
  const google::protobuf::EnumDescriptor* e = google::protobuf::GetEnumDescriptor<E>();
  for (int i = 0; i < e->value_count(); ++i) {
    if (e->value(i)->number() == 0) continue;
    EXPECT_NE(NameOf(e, e->value(i)->number()), "unspecified") << e->value(i)->full_name();
  }
}

TEST(Names, EverySpecEnumValue_HasAName) {
  ExpectEveryValueNamed<ScheduleKind>();
  ExpectEveryValueNamed<LossKind>();
  ExpectEveryValueNamed<OptimizerKind>();
  ExpectEveryValueNamed<Precision>();
  ExpectEveryValueNamed<Balance>();
  ExpectEveryValueNamed<Mode>();
}

TEST(Names, Parse_NamesAliasesAndTorchSpellings) {
  EXPECT_EQ(*Parse<ScheduleKind>("schedule", "1f1b"), SCHEDULE_1F1B);
  EXPECT_EQ(*Parse<ScheduleKind>("schedule", "Interleaved1F1B"), SCHEDULE_INTERLEAVED_1F1B);
  EXPECT_EQ(*Parse<ScheduleKind>("schedule", "ZBVZeroBubble"), SCHEDULE_ZBV);
  EXPECT_EQ(*Parse<ScheduleKind>("schedule", "InterleavedZeroBubble"), SCHEDULE_ZB1P);
  EXPECT_EQ(*Parse<LossKind>("loss", "cross_entropy"), LOSS_CROSS_ENTROPY);
  EXPECT_EQ(*Parse<Precision>("--dtype", "BF16"), PRECISION_BF16);
}

TEST(Names, Parse_Unknown_ListsTheNames) {
  auto bad = Parse<OptimizerKind>("optimizer", "lamb");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "unknown optimizer 'lamb': use sgd, adam, adamw");
  // UNSPECIFIED has no name: it cannot be typed.
  EXPECT_FALSE(Parse<ScheduleKind>("schedule", "unspecified").ok());
  EXPECT_FALSE(Parse<ScheduleKind>("schedule", "").ok());
}

TEST(Names, Name_RoundTrips_UnspecifiedForZero) {
  for (const Choice& c : Choices<LossKind>()) {
    EXPECT_EQ(Name(*Parse<LossKind>("loss", c.name)), c.name);
  }
  EXPECT_EQ(Name(SCHEDULE_KIND_UNSPECIFIED), "unspecified");
  EXPECT_EQ(Name(static_cast<ScheduleKind>(99)), "unspecified");
}

TEST(JobState, TerminalStates_AreExactlySucceededFailedCancelled) {
  std::vector<std::string> terminal;
  for (int i = 0; i < JobState_descriptor()->value_count(); ++i) {
    const auto state = static_cast<JobState>(JobState_descriptor()->value(i)->number());
    if (IsTerminal(state)) terminal.push_back(JobState_Name(state));
  }
  EXPECT_THAT(terminal, ElementsAre("SUCCEEDED", "FAILED", "CANCELLED"));
  EXPECT_FALSE(IsTerminal(static_cast<JobState>(99)));
}

}  // namespace
}  // namespace pippy::names
