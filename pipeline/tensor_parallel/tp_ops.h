// Tensor parallelism's collectives as TorchScript operators, the Megatron-LM pair:
//
//   pippy::tp_copy(x)      forward: x as it is (x is replicated: every rank of the group
//                          holds the same values); backward: the gradient summed across
//                          the group. Put before a colwise Linear: each rank's shard of
//                          the output depends on x, so x's gradient is the sum of theirs.
//   pippy::tp_reduce(x)    forward: x summed across the group (the partial products of a
//                          rowwise Linear); backward: the gradient as it is.
//   pippy::tp_vocab_embedding(weight, indices)
//                          an Embedding whose rows (the vocabulary) are sharded: rank r
//                          holds rows [r * n, (r + 1) * n) of the whole table; ids outside
//                          its rows look up zeros, and the lookups are tp_reduce'd.
//
// The sharding pass (sharding.h) writes them into a stage's graph; the ops are
// registered when this library is linked (alwayslink). They reduce over the calling
// thread's group (ScopedGroup): the runtime sets it for the whole step on the thread
// that runs forwards and backwards (CPU autograd runs backward on the calling thread);
// tp_copy and tp_reduce keep the forward's group for their backward. An op run with no
// group (a shard module loaded elsewhere) throws, saying so.
//
// Tensors of any float dtype are reduced in float32 (the groups' collectives take
// float32) and handed back in their own dtype.
//
// Thread safety: ScopedGroup is per thread; LocalGroup's members may be used from one
// thread each, concurrently.
#ifndef PIPPY_PIPELINE_TENSOR_PARALLEL_TP_OPS_H_
#define PIPPY_PIPELINE_TENSOR_PARALLEL_TP_OPS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pipeline/transport/replica_group.h"

namespace pippy::tp {

// The ops' names, for the sharding pass.
inline constexpr char kCopyOp[] = "pippy::tp_copy";
inline constexpr char kReduceOp[] = "pippy::tp_reduce";
inline constexpr char kVocabEmbeddingOp[] = "pippy::tp_vocab_embedding";

// Makes `group` the calling thread's tensor-parallel group until destroyed (the one
// before it is restored). nullptr: none.
class ScopedGroup {
 public:
  explicit ScopedGroup(transport::ReplicaGroup* group);
  ~ScopedGroup();
  ScopedGroup(const ScopedGroup&) = delete;
  ScopedGroup& operator=(const ScopedGroup&) = delete;

 private:
  transport::ReplicaGroup* previous_;
};

// The calling thread's group (nullptr: none).
transport::ReplicaGroup* CurrentGroup();

// One all-reduce the ops ran on the calling thread: when (the steady clock,
// microseconds), how long, how many bytes, and whether in backward (tp_copy's).
struct CollectiveSlice {
  int64_t begin_us = 0;
  int64_t duration_us = 0;
  int64_t bytes = 0;
  bool backward = false;
};
// The calling thread's all-reduces since the last call, in order (the runtime takes them
// at each step's start and end for its trace). At most 65536 are kept between calls.
std::vector<CollectiveSlice> TakeCollectiveSlices();

// A group of `size` members in one process (threads), for checking shards against the
// unsplit stage (sharding.h) and for tests of the runtime. The sum is taken in member
// order, so every member gets the same bits. A member that waits longer than `timeout`
// for the others gets DEADLINE_EXCEEDED; after Abort() every wait ends with ABORTED.
class LocalGroup {
 public:
  LocalGroup(int size, absl::Duration timeout);
  ~LocalGroup();
  // Member `index`'s handle; valid while the LocalGroup lives.
  transport::ReplicaGroup* member(int index) { return members_[index].get(); }
  int size() const { return size_; }
  // Ends every wait in progress and every later one (a member failed: the others
  // must not wait for it).
  void Abort();

 private:
  class Member;
  struct Round {
    std::vector<at::Tensor> parts;
    int arrived = 0;
    int taken = 0;
    at::Tensor sum;
  };
  absl::Status AllReduce(int index, int64_t round, at::Tensor& flat);

  const int size_;
  const absl::Duration timeout_;
  std::vector<std::unique_ptr<transport::ReplicaGroup>> members_;
  absl::Mutex mu_;
  std::map<int64_t, Round> rounds_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pippy::tp

#endif  // PIPPY_PIPELINE_TENSOR_PARALLEL_TP_OPS_H_
