#include "pipeline/tensor_parallel/tp_ops.h"

#include <chrono>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "torch/csrc/autograd/custom_function.h"
#include "torch/library.h"
#include "torch/torch.h"

namespace pippy::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local transport::ReplicaGroup* t_group = nullptr;
thread_local std::vector<CollectiveSlice> t_slices;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

transport::ReplicaGroup* RequireGroup(const char* op) {
  TORCH_CHECK(t_group != nullptr, op,
              " ran outside a tensor-parallel group: a tensor-parallel shard runs on its group's ranks "
              "(pippy's runtime or pippyctl split's check), not on its own");
  return t_group;
}

// `x` summed across `group`, in x's dtype.
at::Tensor Reduced(transport::ReplicaGroup* group, const at::Tensor& x, const char* what) {
  if (!x.defined()) return x;
  TORCH_CHECK(x.device().is_cpu(), what, ": tensor-parallel groups reduce CPU tensors; this one is on ",
              x.device().str());
  at::Tensor flat = x.scalar_type() == at::kFloat ? x.detach().clone(at::MemoryFormat::Contiguous)
                                                   : x.detach().to(at::kFloat).contiguous();
  if (group->size() > 1) {
    const int64_t begin = NowUs();
    const absl::Status s = group->AllReduceSum(flat);
    if (t_slices.size() < 65536) {
      t_slices.push_back({begin, NowUs() - begin, static_cast<int64_t>(flat.numel() * 4),
                          std::strstr(what, "backward") != nullptr});
    }
    TORCH_CHECK(s.ok(), what, ": the tensor-parallel all-reduce failed on member ", group->index(), " of ",
                group->size(), ": ", s.ToString());
  }
  return x.scalar_type() == at::kFloat ? flat : flat.to(x.scalar_type());
}

int64_t Encode(transport::ReplicaGroup* g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(g)); }
transport::ReplicaGroup* Decode(const c10::IValue& v) {
  return reinterpret_cast<transport::ReplicaGroup*>(static_cast<intptr_t>(v.toInt()));
}

struct CopyFn : public torch::autograd::Function<CopyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->saved_data["group"] = Encode(RequireGroup(kCopyOp));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Reduced(Decode(ctx->saved_data["group"]), grads[0], "pippy::tp_copy (backward)")};
  }
};

struct ReduceFn : public torch::autograd::Function<ReduceFn> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x) {
    return Reduced(RequireGroup(kReduceOp), x, kReduceOp);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0]}; }
};

at::Tensor TpCopy(const at::Tensor& x) { return CopyFn::apply(x); }
at::Tensor TpReduce(const at::Tensor& x) { return ReduceFn::apply(x); }

at::Tensor TpVocabEmbedding(const at::Tensor& weight, const at::Tensor& indices) {
  transport::ReplicaGroup* g = RequireGroup(kVocabEmbeddingOp);
  const int64_t rows = weight.size(0), start = rows * g->index();
  const at::Tensor local = indices - start;
  const at::Tensor outside = (local < 0).logical_or(local >= rows);
  at::Tensor out = at::embedding(weight, local.masked_fill(outside, 0));
  out = out.masked_fill(outside.unsqueeze(-1), 0);
  return ReduceFn::apply(out);
}

}  // namespace

TORCH_LIBRARY(pippy, m) {
  m.def("tp_copy(Tensor x) -> Tensor", &TpCopy);
  m.def("tp_reduce(Tensor x) -> Tensor", &TpReduce);
  m.def("tp_vocab_embedding(Tensor weight, Tensor indices) -> Tensor", &TpVocabEmbedding);
}

ScopedGroup::ScopedGroup(transport::ReplicaGroup* group) : previous_(t_group) { t_group = group; }
ScopedGroup::~ScopedGroup() { t_group = previous_; }
transport::ReplicaGroup* CurrentGroup() { return t_group; }

std::vector<CollectiveSlice> TakeCollectiveSlices() {
  std::vector<CollectiveSlice> out;
  out.swap(t_slices);
  return out;
}

class LocalGroup::Member : public transport::ReplicaGroup {
 public:
  Member(LocalGroup* owner, int index) : owner_(owner), index_(index) {}
  int size() const override { return owner_->size_; }
  int index() const override { return index_; }
  absl::Status AllReduceSum(at::Tensor& flat) override { return owner_->AllReduce(index_, round_++, flat); }

 private:
  LocalGroup* const owner_;
  const int index_;
  int64_t round_ = 0;
};

LocalGroup::LocalGroup(int size, absl::Duration timeout) : size_(size), timeout_(timeout) {
  for (int i = 0; i < size; ++i) members_.push_back(std::make_unique<Member>(this, i));
}
LocalGroup::~LocalGroup() = default;

void LocalGroup::Abort() {
  absl::MutexLock lock(&mu_);
  aborted_ = true;
}

absl::Status LocalGroup::AllReduce(int index, int64_t round, at::Tensor& flat) {
  if (flat.scalar_type() != at::kFloat || !flat.is_contiguous() || !flat.device().is_cpu()) {
    return absl::InvalidArgumentError("the in-process group's all-reduce takes contiguous float32 CPU tensors");
  }
  const absl::Time deadline = absl::Now() + timeout_;
  absl::MutexLock lock(&mu_);
  if (aborted_) return absl::AbortedError("the in-process tensor-parallel group was aborted (a member failed)");
  Round& r = rounds_[round];
  if (r.parts.empty()) r.parts.resize(size_);
  r.parts[index] = flat;
  if (++r.arrived == size_) {
    at::Tensor sum = r.parts[0].clone();
    for (int i = 1; i < size_; ++i) {
      if (r.parts[i].numel() != sum.numel()) {
        aborted_ = true;
        return absl::InvalidArgumentError("members of the in-process group all-reduced different sizes");
      }
      sum.add_(r.parts[i]);
    }
    r.sum = sum;
  }
  auto ready = [this, &r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return r.sum.defined() || aborted_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("member ", index, " of the in-process tensor-parallel group ",
                                                    "waited ", absl::FormatDuration(timeout_),
                                                    " for the others' all-reduce"));
  }
  if (!r.sum.defined()) return absl::AbortedError("the in-process tensor-parallel group was aborted (a member failed)");
  flat.copy_(r.sum);
  if (++r.taken == size_) rounds_.erase(round);
  return absl::OkStatus();
}

}  // namespace pippy::tp
