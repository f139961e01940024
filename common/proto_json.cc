#include "common/proto_json.h"

#include <cmath>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"

namespace pippy {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Double(double d) {
  if (!std::isfinite(d)) return "null";
  return absl::StrFormat("%.17g", d);
}

void Append(const Message& m, std::string* out);

// Element `i` of repeated field `f` (i < 0: the singular field).
void AppendValue(const Message& m, const FieldDescriptor* f, int i, std::string* out) {
  const Reflection* r = m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      absl::StrAppend(out, rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      absl::StrAppend(out, rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      absl::StrAppend(out, rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      absl::StrAppend(out, rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      absl::StrAppend(out, Double(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      absl::StrAppend(out, Double(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      absl::StrAppend(out, (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? "true" : "false");
      break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int v = rep ? r->GetRepeatedEnumValue(m, f, i) : r->GetEnumValue(m, f);
      const auto* e = f->enum_type()->FindValueByNumber(v);
      if (e != nullptr) {
        absl::StrAppend(out, JsonString(e->name()));
      } else {
        absl::StrAppend(out, v);
      }
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
      absl::StrAppend(out, JsonString(f->type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(s) : s));
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      Append(rep ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f), out);
      break;
  }
}

void Append(const Message& m, std::string* out) {
  const Reflection* r = m.GetReflection();
  const auto* d = m.GetDescriptor();
  out->push_back('{');
  bool first = true;
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    // Unset messages, and fields of a oneof other than the one set, are left out.
    if (!f->is_repeated() && (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE || f->containing_oneof() != nullptr ||
                              f->has_optional_keyword()) &&
        !r->HasField(m, f)) {
      continue;
    }
    if (!first) out->append(", ");
    first = false;
    absl::StrAppend(out, JsonString(f->name()), ": ");
    if (f->is_map()) {
      // Entries as an object keyed by the key's text.
      out->push_back('{');
      const int n = r->FieldSize(m, f);
      for (int i = 0; i < n; ++i) {
        const Message& entry = r->GetRepeatedMessage(m, f, i);
        const FieldDescriptor* key = entry.GetDescriptor()->field(0);
        std::string k;
        AppendValue(entry, key, -1, &k);
        if (k.empty() || k[0] != '"') k = JsonString(k);
        if (i > 0) out->append(", ");
        absl::StrAppend(out, k, ": ");
        AppendValue(entry, entry.GetDescriptor()->field(1), -1, out);
      }
      out->push_back('}');
    } else if (f->is_repeated()) {
      out->push_back('[');
      const int n = r->FieldSize(m, f);
      for (int i = 0; i < n; ++i) {
        if (i > 0) out->append(", ");
        AppendValue(m, f, i, out);
      }
      out->push_back(']');
    } else {
      AppendValue(m, f, -1, out);
    }
  }
  out->push_back('}');
}

}  // namespace

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
  return out;
}

std::string ProtoToJson(const google::protobuf::Message& m) {
  std::string out;
  Append(m, &out);
  return out;
}

std::string JsonError(const absl::Status& s) {
  return absl::StrCat("{\"error\": {\"code\": ", JsonString(absl::StatusCodeToString(s.code())),
                      ", \"message\": ", JsonString(s.message()), "}}");
}

}  // namespace pippy
