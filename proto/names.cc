#include "proto/names.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pippy::names {
namespace {

// Lower case without '-' and '_': "Interleaved1F1B" and "interleaved-1f1b" match.
std::string Normalized(absl::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '-' || c == '_') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

}  // namespace

std::vector<Choice> ChoicesOf(const google::protobuf::EnumDescriptor* e) {
  std::vector<Choice> out;
  for (int i = 0; i < e->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* v = e->value(i);
    const google::protobuf::EnumValueOptions& o = v->options();
    if (!o.HasExtension(cli_name)) continue;
    Choice c;
    c.value = v->number();
    c.name = o.GetExtension(cli_name);
    for (int a = 0; a < o.ExtensionSize(cli_alias); ++a) c.aliases.push_back(o.GetExtension(cli_alias, a));
    c.help = o.GetExtension(cli_help);
    out.push_back(std::move(c));
  }
  return out;
}

std::string NameList(const google::protobuf::EnumDescriptor* e) {
  std::vector<std::string> names;
  for (const Choice& c : ChoicesOf(e)) names.push_back(c.name);
  return absl::StrJoin(names, ", ");
}

std::string NameOf(const google::protobuf::EnumDescriptor* e, int value) {
  const google::protobuf::EnumValueDescriptor* v = e->FindValueByNumber(value);
  if (v == nullptr || !v->options().HasExtension(cli_name)) return "unspecified";
  return v->options().GetExtension(cli_name);
}

absl::StatusOr<int> ParseIn(const google::protobuf::EnumDescriptor* e, absl::string_view what,
                            absl::string_view text) {
  std::string wanted = Normalized(text);
  // torch.distributed.pipelining's class names: "Schedule1F1B", "ScheduleGPipe", ...
  for (int pass = 0; pass < 2; ++pass) {
    for (const Choice& c : ChoicesOf(e)) {
      if (Normalized(c.name) == wanted) return c.value;
      for (const std::string& a : c.aliases) {
        if (Normalized(a) == wanted) return c.value;
      }
    }
    if (wanted.rfind("schedule", 0) != 0 || wanted.size() == 8) break;
    wanted = wanted.substr(8);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown ", what, " '", text, "': use ", NameList(e)));
}

}  // namespace pippy::names
