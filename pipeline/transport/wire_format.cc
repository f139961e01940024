#include "pipeline/transport/wire_format.h"

#include <cstring>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"

namespace pippy::transport::wire {
namespace {


enum Kind : uint8_t { kNone = 0, kTensor = 1, kInt = 2, kDouble = 3, kBool = 4, kTuple = 5, kList = 6, kString = 7 };

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

absl::Status Encode(const c10::IValue& v, std::string* out, std::vector<at::Tensor>* tensors) {
  if (v.isNone()) {
    Put<uint8_t>(out, kNone);
  } else if (v.isTensor()) {
    at::Tensor t = v.toTensor();
    t = t.detach().contiguous();
    Put<uint8_t>(out, kTensor);
    Put<uint8_t>(out, static_cast<uint8_t>(t.scalar_type()));
    Put<uint8_t>(out, static_cast<uint8_t>(t.dim()));
    for (int64_t d : t.sizes()) Put<int64_t>(out, d);
    tensors->push_back(t);
  } else if (v.isInt()) {
    Put<uint8_t>(out, kInt);
    Put<int64_t>(out, v.toInt());
  } else if (v.isDouble()) {
    Put<uint8_t>(out, kDouble);
    Put<double>(out, v.toDouble());
  } else if (v.isBool()) {
    Put<uint8_t>(out, kBool);
    Put<uint8_t>(out, v.toBool() ? 1 : 0);
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    Put<uint8_t>(out, kString);
    Put<uint32_t>(out, static_cast<uint32_t>(s.size()));
    out->append(s);
  } else if (v.isTuple() || v.isList()) {
    std::vector<c10::IValue> elems = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
    Put<uint8_t>(out, v.isTuple() ? kTuple : kList);
    Put<uint32_t>(out, static_cast<uint32_t>(elems.size()));
    for (const auto& e : elems) {
      absl::Status s = Encode(e, out, tensors);
      if (!s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("cannot send a value of type ", v.tagKind()));
  }
  return absl::OkStatus();
}

struct Reader {
  const char* p;
  const char* end;
  template <typename T>
  bool Get(T* v) {
    if (end - p < static_cast<ptrdiff_t>(sizeof(T))) return false;
    std::memcpy(v, p, sizeof(T));
    p += sizeof(T);
    return true;
  }
};

// Walks a header without building anything: whether it is well formed (known kinds
// and dtypes, no more elements than bytes left to describe them, at most 64 levels
// deep), and the payload bytes its tensors add up to (false on overflow or beyond
// `limit`). Decode runs only after Scan passed, so nothing is sized by a header that
// could not be valid.
bool Scan(Reader* r, int64_t limit, int64_t* bytes, int depth = 0) {
  uint8_t kind;
  if (depth > 64 || !r->Get(&kind)) return false;
  switch (kind) {
    case kNone: return true;
    case kTensor: {
      uint8_t dtype, ndim;
      if (!r->Get(&dtype) || !r->Get(&ndim)) return false;
      if (dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions)) return false;
      const auto type = static_cast<c10::ScalarType>(dtype);
      if (c10::isQIntType(type) || type == c10::ScalarType::Undefined) return false;
      int64_t n = static_cast<int64_t>(c10::elementSize(type));
      for (int i = 0; i < ndim; ++i) {
        int64_t d;
        if (!r->Get(&d) || d < 0) return false;
        if (d > 0 && n > limit / d) return false;
        n *= d;
      }
      if (n > limit - *bytes) return false;
      *bytes += n;
      return true;
    }
    case kInt: { int64_t x; return r->Get(&x); }
    case kDouble: { double x; return r->Get(&x); }
    case kBool: { uint8_t x; return r->Get(&x); }
    case kString: {
      uint32_t n;
      if (!r->Get(&n) || r->end - r->p < n) return false;
      r->p += n;
      return true;
    }
    case kTuple:
    case kList: {
      uint32_t n;
      if (!r->Get(&n) || r->end - r->p < n) return false;  // every element takes a byte at least
      for (uint32_t i = 0; i < n; ++i) {
        if (!Scan(r, limit, bytes, depth + 1)) return false;
      }
      return true;
    }
    default: return false;
  }
}

// Rebuilds the value, allocating (empty) tensors to receive the payload into.
// REQUIRES: Scan passed over the same bytes.
bool Decode(Reader* r, c10::IValue* v, std::vector<at::Tensor>* tensors, const Allocator& alloc, int depth = 0) {
  uint8_t kind;
  if (depth > 64 || !r->Get(&kind)) return false;
  switch (kind) {
    case kNone: *v = c10::IValue(); return true;
    case kTensor: {
      uint8_t dtype, ndim;
      if (!r->Get(&dtype) || !r->Get(&ndim)) return false;
      std::vector<int64_t> sizes(ndim);
      for (auto& d : sizes) {
        if (!r->Get(&d) || d < 0) return false;
      }
      if (dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions)) return false;
      at::Tensor t = alloc(sizes, static_cast<c10::ScalarType>(dtype));
      tensors->push_back(t);
      *v = t;
      return true;
    }
    case kInt: { int64_t x; if (!r->Get(&x)) return false; *v = x; return true; }
    case kDouble: { double x; if (!r->Get(&x)) return false; *v = x; return true; }
    case kBool: { uint8_t x; if (!r->Get(&x)) return false; *v = x != 0; return true; }
    case kString: {
      uint32_t n;
      if (!r->Get(&n) || r->end - r->p < n) return false;
      *v = std::string(r->p, n);
      r->p += n;
      return true;
    }
    case kTuple:
    case kList: {
      uint32_t n;
      if (!r->Get(&n)) return false;
      std::vector<c10::IValue> elems(n);
      for (auto& e : elems) {
        if (!Decode(r, &e, tensors, alloc, depth + 1)) return false;
      }
      if (kind == kTuple) {
        *v = c10::ivalue::Tuple::create(std::move(elems));
      } else {
        c10::impl::GenericList list(c10::AnyType::get());
        for (auto& e : elems) list.push_back(e);
        *v = list;
      }
      return true;
    }
    default: return false;
  }
}

}  // namespace

absl::Status EncodeHeader(const c10::IValue& value, std::string* header, std::vector<at::Tensor>* tensors) {
  Put<uint32_t>(header, kMagic);
  return Encode(value, header, tensors);
}

void AppendInlinePayload(const std::vector<at::Tensor>& tensors, std::string* header) {
  std::memcpy(header->data(), &kMagicInline, sizeof(kMagicInline));
  for (const at::Tensor& t : tensors) {
    header->append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
  }
}

absl::StatusOr<c10::IValue> DecodeHeader(const char* data, size_t size, const Allocator& alloc,
                                         std::vector<at::Tensor>* tensors, bool* inline_payload,
                                         int64_t max_payload_bytes) {
  Reader r{data, data + size};
  uint32_t magic = 0;
  c10::IValue value;
  const size_t first = tensors->size();
  const bool ok_magic = r.Get(&magic) && (magic == kMagic || (magic == kMagicInline && inline_payload != nullptr));
  if (!ok_magic) return absl::DataLossError("malformed message header (not a pippy message, or a corrupted one)");
  Reader scan = r;
  int64_t payload = 0;
  if (!Scan(&scan, max_payload_bytes, &payload)) {
    return absl::DataLossError(absl::StrCat("malformed message header (a corrupted one, or tensors of more than ",
                                            max_payload_bytes, " bytes in all)"));
  }
  if (magic == kMagicInline && payload != scan.end - scan.p) {
    return absl::DataLossError(absl::StrCat("malformed inline message: ",
                                            payload > scan.end - scan.p ? "fewer" : "more",
                                            " payload bytes than its header describes (", payload, " described, ",
                                            scan.end - scan.p, " follow)"));
  }
  if (!Decode(&r, &value, tensors, alloc)) {
    return absl::DataLossError("malformed message header (not a pippy message, or a corrupted one)");
  }
  if (inline_payload != nullptr) *inline_payload = magic == kMagicInline;
  if (magic != kMagicInline) return value;
  for (size_t i = first; i < tensors->size(); ++i) {
    at::Tensor& t = (*tensors)[i];
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    if (static_cast<size_t>(r.end - r.p) < bytes) {
      return absl::DataLossError("malformed inline message: fewer payload bytes than its header describes");
    }
    if (bytes > 0) std::memcpy(t.data_ptr(), r.p, bytes);
    r.p += bytes;
  }
  if (r.p != r.end) return absl::DataLossError("malformed inline message: more payload bytes than its header describes");
  return value;
}

}  // namespace pippy::transport::wire
