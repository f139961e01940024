#include "pipeline/transport/transport.h"

#include "absl/strings/str_cat.h"

namespace pippy::transport {

uint64_t Tag::Pack() const {
  return (static_cast<uint64_t>(kind) & 0xF) << 60 | (static_cast<uint64_t>(step) & 0xFFFF) << 44 |
         (static_cast<uint64_t>(microbatch) & 0xFFF) << 32 | (static_cast<uint64_t>(src_stage) & 0xFF) << 24 |
         (static_cast<uint64_t>(dst_stage) & 0xFF) << 16 | (static_cast<uint64_t>(index) & 0xFFFF);
}

Tag Tag::Unpack(uint64_t p) {
  Tag t;
  t.kind = static_cast<Kind>((p >> 60) & 0xF);
  t.step = static_cast<uint32_t>((p >> 44) & 0xFFFF);
  t.microbatch = static_cast<uint32_t>((p >> 32) & 0xFFF);
  t.src_stage = static_cast<uint32_t>((p >> 24) & 0xFF);
  t.dst_stage = static_cast<uint32_t>((p >> 16) & 0xFF);
  t.index = static_cast<uint32_t>(p & 0xFFFF);
  return t;
}

std::string Tag::ToString() const {
  const char* k = "?";
  switch (kind) {
    case Kind::kActivation: k = "activation"; break;
    case Kind::kGradient: k = "gradient"; break;
    case Kind::kTiedGradient: k = "tied-gradient"; break;
    case Kind::kGradNorm: k = "grad-norm"; break;
    case Kind::kControl: k = "control"; break;
  }
  return absl::StrCat(k, " step=", step, " mb=", microbatch, " stage ", src_stage, "->", dst_stage, " #", index);
}

}  // namespace pippy::transport
