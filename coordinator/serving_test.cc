// ServingQueue without a pipeline: a dispatch that records each micro-batch, and
// answers built here (the identity model: each micro-batch's output is its input).
#include "coordinator/serving.h"

#include <deque>
#include <map>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/torch.h"

namespace pippy::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// torch.save's format (what clients send and the queue sends on), both ways.
std::string Pickle(const c10::IValue& v) {
  std::vector<char> bytes = torch::jit::pickle_save(v);
  return std::string(bytes.data(), bytes.size());
}
c10::IValue Unpickle(const std::string& bytes) {
  return torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
}

// What the pipeline was sent.
struct Sent {
  int64_t step;
  int64_t rows;
  at::Tensor input;  // rank 0's, the micro-batch's rows
};

class ServingQueueTest : public ::testing::Test {
 protected:
  // A queue of one 2-D float32 input "x" and one stage; micro-batches may carry
  // `budget` bytes of tensors (the message bound less its 64 KiB of framing room).
  void Make(int64_t budget, bool start = true, int max_batch = 32) {
    ServingQueue::Options o;
    o.job_id = "job-t";
    o.max_batch = max_batch;
    o.max_delay = absl::ZeroDuration();
    o.stages = 1;
    o.max_inflight = 8;
    o.input_names = {"x"};
    o.input_dtypes = {"float32"};
    o.input_dims = {2};
    o.max_message_bytes = budget + (int64_t{64} << 10);
    queue_ = std::make_unique<ServingQueue>(o);
    if (start) Start();
  }
  void Start() {
    queue_->Start(0, {{0}}, [this](const ServeBatch& b, const std::vector<std::string>& inputs) {
      const int64_t step = b.step(), rows = b.rows();
      c10::IValue args = Unpickle(inputs[0]);
      absl::MutexLock lock(&mu_);
      sent_.push_back({step, rows, args.toTupleRef().elements()[0].toTensor()});
      return true;
    });
  }
  // Submits `x` as one request; its answer lands in answers_[tag].
  absl::Status Submit(const at::Tensor& x, const std::string& tag) {
    return queue_->Submit(Pickle(x), [this, tag](ServingQueue::Answer a) {
      absl::MutexLock lock(&mu_);
      answers_[tag] = std::move(a);
    });
  }
  // Waits (≤ 10 s) until `n` micro-batches were sent; false if they were not.
  bool WaitSent(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sent_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
  bool WaitAnswered(const std::string& tag) {
    absl::MutexLock lock(&mu_);
    auto there = [this, tag]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return answers_.count(tag) > 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&there), absl::Seconds(10));
  }
  bool Answered(const std::string& tag) {
    absl::MutexLock lock(&mu_);
    return answers_.count(tag) > 0;
  }
  Sent SentAt(size_t i) {
    absl::MutexLock lock(&mu_);
    return sent_.at(i);
  }
  ServingQueue::Answer AnswerOf(const std::string& tag) {
    absl::MutexLock lock(&mu_);
    return answers_.at(tag);
  }
  // The identity model's answer to sent micro-batch i.
  void AnswerIdentity(size_t i) {
    Sent s = SentAt(i);
    ServeResult r;
    r.set_attempt(0);
    r.set_step(s.step);
    r.set_ok(true);
    r.set_output(Pickle(s.input));
    queue_->OnResult(r);
  }
  // The model refused micro-batch i (a stage's forward failed on one of its requests).
  void AnswerAborted(size_t i) { AnswerFailed(i, /*too_large=*/false, "index out of range in self"); }
  // The worker found micro-batch i's output larger than a message.
  void AnswerTooLarge(size_t i) {
    AnswerFailed(i, /*too_large=*/true, "the output of N rows is M bytes, more than one message may carry");
  }
  void AnswerFailed(size_t i, bool too_large, const std::string& error) {
    ServeResult r;
    r.set_attempt(0);
    r.set_step(SentAt(i).step);
    r.set_ok(false);
    r.set_aborted(!too_large);
    r.set_too_large(too_large);
    r.set_error(error);
    queue_->OnResult(r);
  }

  std::unique_ptr<ServingQueue> queue_;
  absl::Mutex mu_;
  std::vector<Sent> sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ServingQueue::Answer> answers_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ServingQueueTest, MicroBatchesTakeNoMoreRowsThanTheMessageBoundCarries) {
  Make(/*budget=*/1000);  // a row of 25 float32 is 100 bytes: 10 rows per micro-batch
  at::Tensor x = torch::arange(25 * 25, torch::kFloat32).reshape({25, 25});
  ASSERT_TRUE(Submit(x, "a").ok());
  // Two leave at once (each full by bytes); the last 5 rows once the pipeline has room.
  ASSERT_TRUE(WaitSent(2));
  AnswerIdentity(0);
  AnswerIdentity(1);
  ASSERT_TRUE(WaitSent(3));
  AnswerIdentity(2);
  std::vector<int64_t> rows;
  for (size_t i = 0; i < 3; ++i) {
    rows.push_back(SentAt(i).rows);
    EXPECT_EQ(SentAt(i).input.size(0), SentAt(i).rows);
    EXPECT_LE(SentAt(i).input.nbytes(), 1000u);
  }
  EXPECT_THAT(rows, ElementsAre(10, 10, 5));
  ASSERT_TRUE(WaitAnswered("a"));
  ServingQueue::Answer a = AnswerOf("a");
  ASSERT_TRUE(a.status.ok()) << a.status;
  at::Tensor out = Unpickle(a.output).toTensor();
  EXPECT_TRUE(torch::equal(out, x));  // its parts, put back together in order
}

TEST_F(ServingQueueTest, ARequestOneRowOfWhichExceedsTheBound_IsRefusedAlone) {
  Make(/*budget=*/1000);
  auto refused = Submit(torch::zeros({2, 300}), "big");  // 1200 bytes a row
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("one row of this request holds 1200 bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("--max-message-mib"));
  // The queue goes on.
  ASSERT_TRUE(Submit(torch::ones({2, 25}), "small").ok());
  ASSERT_TRUE(WaitSent(1));
  AnswerIdentity(0);
  ASSERT_TRUE(WaitAnswered("small"));
  EXPECT_TRUE(AnswerOf("small").status.ok());
}

TEST_F(ServingQueueTest, AnOutputTooLarge_SendsEachRequestAlone_ThenFailsOnlyTheOneStillTooLarge) {
  Make(/*budget=*/1 << 20, /*start=*/false);
  // Both wait for the pipeline, then leave together in one micro-batch.
  ASSERT_TRUE(Submit(torch::ones({3, 4}), "a").ok());
  ASSERT_TRUE(Submit(torch::full({2, 4}, 2.0), "b").ok());
  Start();
  ASSERT_TRUE(WaitSent(1));
  ASSERT_EQ(SentAt(0).rows, 5);
  AnswerTooLarge(0);
  // Each goes again alone, one after the other (one stage: one in the pipeline).
  for (size_t i : {1, 2}) {
    ASSERT_TRUE(WaitSent(i + 1));
    if (SentAt(i).rows == 3) {
      AnswerTooLarge(i);  // a's output is too large even alone
    } else {
      ASSERT_EQ(SentAt(i).rows, 2);
      AnswerIdentity(i);
    }
  }
  ASSERT_TRUE(WaitAnswered("a"));
  ASSERT_TRUE(WaitAnswered("b"));
  EXPECT_EQ(AnswerOf("a").status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(AnswerOf("a").status.message(), HasSubstr("send fewer rows per request"));
  ASSERT_TRUE(AnswerOf("b").status.ok()) << AnswerOf("b").status;
  const std::string& out = AnswerOf("b").output;
  EXPECT_TRUE(torch::equal(Unpickle(out).toTensor(), torch::full({2, 4}, 2.0)));
}

// The race of a request split over two micro-batches: A (6 rows, the culprit) fills the
// first and half the second, B (2 rows, innocent) the rest. The first fails: A alone
// goes again. The second fails too, its A rows stale by then: B, its only live request,
// was not alone in it and must go again alone rather than fail for A's rows.
TEST_F(ServingQueueTest, AnInnocentRequestSharingAStaleSegmentOfTheCulprit_IsSentAgainAlone) {
  Make(/*budget=*/1 << 20, /*start=*/false, /*max_batch=*/4);
  ASSERT_TRUE(Submit(torch::ones({6, 4}), "a").ok());
  ASSERT_TRUE(Submit(torch::full({2, 4}, 2.0), "b").ok());
  Start();
  ASSERT_TRUE(WaitSent(2));  // both full (4 rows): A[0:4], then A[4:6] + B[0:2]
  ASSERT_EQ(SentAt(0).rows, 4);
  ASSERT_EQ(SentAt(1).rows, 4);
  AnswerAborted(0);  // A goes again alone
  AnswerAborted(1);  // A's rows here are stale; B goes again alone
  // Then each alone, in turn: A fails in the model again (its first 4 rows; the rest is
  // dropped with it), B is answered.
  for (size_t i = 2; i < 6 && !(Answered("a") && Answered("b")); ++i) {
    ASSERT_TRUE(WaitSent(i + 1)) << "micro-batch " << i;
    if (torch::equal(SentAt(i).input, torch::full({2, 4}, 2.0))) {
      AnswerIdentity(i);
    } else {
      AnswerAborted(i);
    }
  }
  ASSERT_TRUE(WaitAnswered("a"));
  ASSERT_TRUE(WaitAnswered("b"));
  EXPECT_EQ(AnswerOf("a").status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(AnswerOf("a").status.message(), HasSubstr("the model failed on this request"));
  ASSERT_TRUE(AnswerOf("b").status.ok()) << AnswerOf("b").status;
  const std::string& out = AnswerOf("b").output;
  EXPECT_TRUE(torch::equal(Unpickle(out).toTensor(), torch::full({2, 4}, 2.0)));
}

}  // namespace
}  // namespace pippy::coordinator
