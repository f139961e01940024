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
    case Kind::kEvalActivation: k = "eval-activation"; break;
  }
  return absl::StrCat(k, " step=", step, " mb=", microbatch, " stage ", src_stage, "->", dst_stage, " #", index);
}

c10::IValue MapTensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) return fn(value.toTensor());
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& e : value.toTupleRef().elements()) elements.push_back(MapTensors(e, fn));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isList()) {
    c10::impl::GenericList out(value.toList().elementType());
    for (const c10::IValue& e : value.toList()) out.push_back(MapTensors(e, fn));
    return out;
  }
  return value;
}

c10::IValue ToDevice(const c10::IValue& value, const c10::Device& device) {
  return MapTensors(value, [&](const at::Tensor& t) { return !t.defined() || t.device() == device ? t : t.to(device); });
}

}  // namespace pippy::transport
