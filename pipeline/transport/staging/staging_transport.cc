#include "pipeline/transport/staging/staging_transport.h"

#include <utility>
#include <vector>

#include "ATen/core/ivalue.h"
#include "ATen/core/List.h"

namespace pippy::transport::staging {

c10::IValue ToDevice(const c10::IValue& value, const c10::Device& device) {
  return MapTensors(value, [&](const at::Tensor& t) { return !t.defined() || t.device() == device ? t : t.to(device); });
}

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

namespace {

// A receive whose value is handed out on the rank's device.
class StagedRecv : public Work {
 public:
  StagedRecv(std::shared_ptr<Work> inner, c10::Device device) : inner_(std::move(inner)), device_(device) {}
  absl::Status Wait(absl::Duration timeout) override { return inner_->Wait(timeout); }
  bool IsCompleted() override { return inner_->IsCompleted(); }
  void Cancel() override { inner_->Cancel(); }
  c10::IValue Value() override { return ToDevice(inner_->Value(), device_); }

 private:
  std::shared_ptr<Work> inner_;
  c10::Device device_;
};

}  // namespace

std::shared_ptr<Work> StagingTransport::Send(int peer, const Tag& tag, c10::IValue value) {
  const c10::Device host(c10::kCPU);
  if (HasTensorOffDevice(value, host)) value = ToDevice(value, host);
  return host_->Send(peer, tag, std::move(value));
}

std::shared_ptr<Work> StagingTransport::Recv(int peer, const Tag& tag) {
  std::shared_ptr<Work> inner = host_->Recv(peer, tag);
  if (device_.is_cpu()) return inner;
  return std::make_shared<StagedRecv>(std::move(inner), device_);
}

}  // namespace pippy::transport::staging
