#include "pipeline/transport/staging/device_copier.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::staging {

bool HasTensorOffDevice(const c10::IValue& value, const c10::Device& device) {
  if (value.isTensor()) return value.toTensor().defined() && value.toTensor().device() != device;
  if (value.isTuple()) {
    for (const c10::IValue& e : value.toTupleRef().elements()) {
      if (HasTensorOffDevice(e, device)) return true;
    }
  }
  if (value.isList()) {
    for (const c10::IValue& e : value.toList()) {
      if (HasTensorOffDevice(e, device)) return true;
    }
  }
  return false;
}

absl::StatusOr<DeviceCopier::Staged> SyncCopier::ToHost(const c10::IValue& value) {
  const c10::Device host(c10::kCPU);
  Staged staged;
  try {
    staged.host = HasTensorOffDevice(value, host) ? transport::ToDevice(value, host) : value;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(device_.str(), ": staging a value to the host: ", e.what()));
  }
  return staged;
}

absl::StatusOr<c10::IValue> SyncCopier::ToDevice(const c10::IValue& value) {
  try {
    return transport::ToDevice(value, device_);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(device_.str(), ": staging a value onto the device: ", e.what()));
  }
}

std::function<at::Tensor(int64_t nbytes)> ReceiveBuffersFor(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  return [](int64_t nbytes) { return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)); };
}

}  // namespace pippy::transport::staging
