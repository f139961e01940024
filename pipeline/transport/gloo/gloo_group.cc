#include "pipeline/transport/gloo/gloo_group.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gloo/allreduce.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "gloo/transport/context.h"
#include "gloo/transport/tcp/device.h"

namespace pippy::transport::gloo_group {
namespace {

// gloo::Context with the transport context set from outside (gloo's own rendezvous
// needs a store; pippy's placer hands the addresses around instead).
class Context : public ::gloo::Context {
 public:
  Context(int rank, int size) : ::gloo::Context(rank, size) {}
  void Attach(std::shared_ptr<::gloo::transport::Device> device,
              std::shared_ptr<::gloo::transport::Context> transport) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

absl::Status FromGloo(const std::exception& e, const std::string& what) {
  const std::string msg = e.what();
  if (msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": ", msg));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", msg));
}

void AppendU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

}  // namespace

struct GlooGroup::State {
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<::gloo::transport::Context> transport;
  std::shared_ptr<Context> context;
};

GlooGroup::~GlooGroup() {
  if (state_ != nullptr && state_->context != nullptr && connected_) {
    try {
      state_->context->closeConnections();
    } catch (const std::exception&) {
    }
  }
}

absl::StatusOr<std::unique_ptr<GlooGroup>> GlooGroup::Create(int index, int size, const std::string& hostname,
                                                             absl::Duration timeout) {
  if (size < 1 || index < 0 || index >= size) {
    return absl::InvalidArgumentError(absl::StrCat("replica ", index, " of ", size, " does not exist"));
  }
  std::unique_ptr<GlooGroup> g(new GlooGroup());
  g->index_ = index;
  g->size_ = size;
  g->timeout_ = timeout;
  g->state_ = std::make_unique<State>();
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    g->state_->device = ::gloo::transport::tcp::CreateDevice(attr);
    g->state_->transport = g->state_->device->createContext(index, size);
    g->state_->transport->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
    // One endpoint per other member, in member order: [len][bytes]...
    for (int i = 0; i < size; ++i) {
      if (i == index) continue;
      std::vector<char> bytes = g->state_->transport->createPair(i)->address().bytes();
      AppendU32(&g->address_, static_cast<uint32_t>(bytes.size()));
      g->address_.append(bytes.data(), bytes.size());
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot open gloo endpoints on ", hostname, ": ", e.what(),
                                               " (pippy-worker --replica-host: an address of this host)"));
  }
  return g;
}

absl::Status GlooGroup::Connect(const std::vector<std::string>& addresses) {
  if (static_cast<int>(addresses.size()) != size_) {
    return absl::InvalidArgumentError(absl::StrCat("replica group of ", size_, " got ", addresses.size(), " addresses"));
  }
  try {
    for (int i = 0; i < size_; ++i) {
      if (i == index_) continue;
      // Member i's endpoints are in member order without i itself; ours is at
      // position index_ (or index_ - 1 when it comes after i).
      const std::string& all = addresses[i];
      const int want = index_ < i ? index_ : index_ - 1;
      size_t off = 0;
      std::vector<char> bytes;
      for (int k = 0; k <= want; ++k) {
        uint32_t len = 0;
        if (off + 4 > all.size()) return absl::InvalidArgumentError(absl::StrCat("replica ", i, "'s address is cut short"));
        std::memcpy(&len, all.data() + off, 4);
        off += 4;
        if (off + len > all.size()) return absl::InvalidArgumentError(absl::StrCat("replica ", i, "'s address is cut short"));
        if (k == want) bytes.assign(all.data() + off, all.data() + off + len);
        off += len;
      }
      state_->transport->getPair(i)->connect(bytes);
    }
    state_->context = std::make_shared<Context>(index_, size_);
    state_->context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    state_->context->Attach(state_->device, state_->transport);
  } catch (const std::exception& e) {
    return FromGloo(e, absl::StrCat("replica ", index_, " connecting to its ", size_ - 1,
                                     " peer replica(s) (can the workers reach each other at their --replica-host?)"));
  }
  connected_ = true;
  return absl::OkStatus();
}

absl::Status GlooGroup::AllReduceSum(at::Tensor& flat) {
  if (!connected_) return absl::FailedPreconditionError("AllReduceSum before Connect");
  if (flat.scalar_type() != at::kFloat || !flat.is_contiguous() || !flat.device().is_cpu()) {
    return absl::InvalidArgumentError("the replica all-reduce takes contiguous float32 CPU tensors");
  }
  if (size_ == 1 || flat.numel() == 0) return absl::OkStatus();
  try {
    ::gloo::AllreduceOptions opts(state_->context);
    opts.setOutput(flat.data_ptr<float>(), static_cast<size_t>(flat.numel()));
    opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&::gloo::sum<float>));
    opts.setTag(tag_++);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    ::gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return FromGloo(e, absl::StrCat("replica ", index_, ": gradient all-reduce"));
  }
  return absl::OkStatus();
}

}  // namespace pippy::transport::gloo_group
