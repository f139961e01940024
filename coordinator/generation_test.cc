// GenerationQueue's scheduling against a fake pipeline that answers each micro-batch
// with a token computed from the row (the sequence's last token + 1, so every sequence
// is a predictable count): batches hold one length, at most ceil(active / in-flight)
// rows; prefills are chunked and alternate with decodes; slots are reused; stop, length
// and max_seq end sequences; cancel and Pause free slots.
#include "coordinator/generation.h"

#include <map>
#include <set>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/torch.h"

namespace pippy::coordinator {
namespace {

struct Sent {
  ServeBatch batch;
  at::Tensor idx, pos, slots;
};

class GenerationQueueTest : public ::testing::Test {
 protected:
  void Make(GenerationQueue::Options o) {
    o.job_id = "job-g";
    queue_ = std::make_unique<GenerationQueue>(o);
  }
  // Dispatches are kept; Answer() returns them, one at a time, in order.
  void Start() {
    queue_->Start(0, {{0, 1, 2}}, [this](const ServeBatch& b, const std::vector<std::string>& inputs) {
      c10::IValue args = torch::jit::pickle_load(std::vector<char>(inputs[0].begin(), inputs[0].end()));
      const auto& e = args.toTupleRef().elements();
      absl::MutexLock lock(&mu_);
      sent_.push_back({b, e[0].toTensor(), e[1].toTensor(), e[2].toTensor()});
      return true;
    });
  }
  // Waits (<= 10 s) for the next dispatched micro-batch, answers it (each sampled row:
  // its last token + 1) and returns it; false when none came.
  bool Answer(Sent* out) {
    {
      absl::MutexLock lock(&mu_);
      auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !sent_.empty(); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&any), absl::Seconds(10))) return false;
      *out = sent_.front();
      sent_.pop_front();
    }
    ServeResult r;
    r.set_attempt(0);
    r.set_step(out->batch.step());
    r.set_ok(true);
    const int64_t L = out->idx.size(1);
    for (int64_t b = 0; b < out->idx.size(0); ++b) {
      r.add_tokens(out->batch.sample(static_cast<int>(b)).sample() ? out->idx[b][L - 1].item<int64_t>() + 1 : -1);
    }
    queue_->OnResult(r);
    return true;
  }
  int Inflight() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(sent_.size());
  }
  struct Seq {
    std::vector<int64_t> tokens;
    absl::Status status;
    std::string reason;
    bool ended = false;
  };
  GenerationQueue::OnEvent Collect(const std::string& name) {
    return [this, name](GenerationQueue::Event e) {
      absl::MutexLock lock(&mu_);
      Seq& s = seqs_[name];
      s.tokens.insert(s.tokens.end(), e.tokens.begin(), e.tokens.end());
      if (!e.status.ok() || e.done) {
        EXPECT_FALSE(s.ended) << name << " ended twice";
        s.ended = true;
        s.status = e.status;
        s.reason = e.finish_reason;
      }
    };
  }
  absl::Status Submit(const std::string& name, std::vector<int64_t> prompt, int new_tokens,
                      std::vector<int64_t> stops = {}, std::shared_ptr<std::atomic<bool>> cancelled = nullptr) {
    GenerationQueue::Request r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = new_tokens;
    r.stop_tokens = std::move(stops);
    return queue_->Submit(std::move(r), Collect(name), cancelled);
  }
  bool Ended(const std::string& name) {
    absl::MutexLock lock(&mu_);
    return seqs_.count(name) > 0 && seqs_[name].ended;
  }
  Seq Get(const std::string& name) {
    absl::MutexLock lock(&mu_);
    return seqs_[name];
  }
  // Answers micro-batches until every named sequence ended (<= 2000), recording them.
  std::vector<Sent> RunUntilEnded(const std::vector<std::string>& names) {
    std::vector<Sent> seen;
    for (int i = 0; i < 2000; ++i) {
      bool all = true;
      for (const auto& n : names) all = all && Ended(n);
      if (all) break;
      Sent s;
      if (!Answer(&s)) break;
      seen.push_back(s);
    }
    return seen;
  }

  absl::Mutex mu_;
  std::deque<Sent> sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Seq> seqs_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<GenerationQueue> queue_;
};

GenerationQueue::Options Opts(int slots, int inflight, int chunk, int max_seq = 64) {
  GenerationQueue::Options o;
  o.max_inflight = inflight;
  o.max_batch = slots;
  o.max_slots = slots;
  o.max_seq = max_seq;
  o.prefill_chunk = chunk;
  o.vocab = 1000;
  return o;
}

TEST_F(GenerationQueueTest, EverySequenceGetsItsTokensThroughGroupsOfOneLength) {
  Make(Opts(/*slots=*/4, /*inflight=*/2, /*chunk=*/4));
  Start();
  // Six prompts of different lengths, more than the slots: two wait for a slot.
  std::vector<std::string> names;
  for (int i = 0; i < 6; ++i) {
    std::vector<int64_t> prompt(static_cast<size_t>(3 + 2 * i), 7);
    prompt.back() = 100 * (i + 1);
    names.push_back("s" + std::to_string(i));
    ASSERT_TRUE(Submit(names.back(), prompt, 5 + i).ok());
  }
  std::vector<Sent> seen = RunUntilEnded(names);
  for (int i = 0; i < 6; ++i) {
    Seq s = Get(names[static_cast<size_t>(i)]);
    ASSERT_TRUE(s.ended && s.status.ok()) << names[static_cast<size_t>(i)] << ": " << s.status;
    std::vector<int64_t> want;
    for (int k = 1; k <= 5 + i; ++k) want.push_back(100 * (i + 1) + k);
    EXPECT_EQ(s.tokens, want) << names[static_cast<size_t>(i)];
    EXPECT_EQ(s.reason, "length");
  }
  int prefills = 0, decodes = 0;
  for (const Sent& s : seen) {
    const int64_t B = s.idx.size(0), L = s.idx.size(1);
    EXPECT_EQ(s.pos.sizes(), s.idx.sizes());  // one length per micro-batch: no padding
    EXPECT_LE(B, 2) << "at most ceil(4 active / 2 in flight) rows";
    EXPECT_LE(B * L, 4) << "a prefill holds at most one chunk of tokens";
    std::set<int64_t> slots;
    for (int64_t b = 0; b < B; ++b) slots.insert(s.slots[b].item<int64_t>());
    EXPECT_EQ(static_cast<int64_t>(slots.size()), B) << "a sequence is in one row";
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_GE(s.slots[b].item<int64_t>(), 0);
      EXPECT_LT(s.slots[b].item<int64_t>(), 4);
      for (int64_t l = 1; l < L; ++l) EXPECT_EQ(s.pos[b][l].item<int64_t>(), s.pos[b][l - 1].item<int64_t>() + 1);
    }
    (s.batch.prefill() ? prefills : decodes)++;
    EXPECT_EQ(s.batch.sample_size(), B);
  }
  EXPECT_GT(prefills, 6) << "prompts of up to 13 tokens in chunks of 4";
  EXPECT_GT(decodes, 0);
}

TEST_F(GenerationQueueTest, ALongPromptsChunksAlternateWithTheDecodes) {
  Make(Opts(/*slots=*/2, /*inflight=*/1, /*chunk=*/4));
  Start();
  ASSERT_TRUE(Submit("short", {1}, 30).ok());
  Sent s;
  ASSERT_TRUE(Answer(&s));  // its prefill: it decodes from now on
  ASSERT_TRUE(Answer(&s));
  ASSERT_FALSE(s.batch.prefill());
  ASSERT_TRUE(Submit("long", std::vector<int64_t>(20, 3), 2).ok());  // 5 chunks of 4
  std::string order;
  for (int i = 0; i < 12; ++i) {
    ASSERT_TRUE(Answer(&s));
    order += s.batch.prefill() ? "P" : "d";
  }
  EXPECT_EQ(order.substr(0, 10), "PdPdPdPdPd") << order;  // never two chunks in a row while decodes wait
  RunUntilEnded({"short", "long"});
  EXPECT_EQ(Get("long").tokens, (std::vector<int64_t>{4, 5}));
}

TEST_F(GenerationQueueTest, AGroupLargerThanAMicroBatchTakesTurns) {
  GenerationQueue::Options o = Opts(/*slots=*/6, /*inflight=*/1, /*chunk=*/8);
  o.max_batch = 2;  // 6 sequences in one group, 2 rows per micro-batch
  Make(o);
  Start();
  std::vector<std::string> names;
  for (int i = 0; i < 6; ++i) {
    names.push_back("s" + std::to_string(i));
    ASSERT_TRUE(Submit(names.back(), {100 * (i + 1)}, 4).ok());
  }
  std::vector<Sent> seen = RunUntilEnded(names);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(Get(names[static_cast<size_t>(i)]).tokens.size(), 4u) << names[static_cast<size_t>(i)];
  // Every sequence is served once in every 3 micro-batches: none waits more than 2 turns.
  std::map<int64_t, int> last;  // slot -> index of its last micro-batch
  for (int k = 0; k < static_cast<int>(seen.size()); ++k) {
    EXPECT_LE(seen[static_cast<size_t>(k)].idx.size(0), 2);
    for (int64_t b = 0; b < seen[static_cast<size_t>(k)].idx.size(0); ++b) {
      const int64_t slot = seen[static_cast<size_t>(k)].slots[b].item<int64_t>();
      if (last.count(slot) > 0) {
        EXPECT_LE(k - last[slot], 3) << "slot " << slot << " at micro-batch " << k;
      }
      last[slot] = k;
    }
  }
}

TEST_F(GenerationQueueTest, TwoMicroBatchesInFlightWhileSequencesAreEnough) {
  Make(Opts(/*slots=*/4, /*inflight=*/2, /*chunk=*/8));
  Start();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Submit("s" + std::to_string(i), {1, 2}, 20).ok());
  // Without answers, the scheduler fills the pipeline: 2 micro-batches, then waits.
  for (int i = 0; i < 100 && Inflight() < 2; ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(Inflight(), 2);
  std::vector<Sent> seen = RunUntilEnded({"s0", "s1", "s2", "s3"});
  for (int i = 0; i < 4; ++i) EXPECT_EQ(Get("s" + std::to_string(i)).tokens.size(), 20u);
  ServingStats st = queue_->Stats();
  EXPECT_EQ(st.generation().tokens(), 80);
  EXPECT_EQ(st.generation().slots_in_use(), 0);
  // Once the prompts are in (the first few micro-batches, as they arrived one by one)
  // and until the first sequences end (the last few), the 4 go as 2 groups of 2.
  std::vector<int64_t> decode_rows;
  for (const Sent& s : seen) {
    if (!s.batch.prefill()) decode_rows.push_back(s.idx.size(0));
  }
  ASSERT_GT(decode_rows.size(), 30u);
  for (size_t i = 4; i + 4 < decode_rows.size(); ++i) EXPECT_EQ(decode_rows[i], 2) << "decode micro-batch " << i;
}

TEST_F(GenerationQueueTest, StopTokenMaxSeqAndRefusals) {
  Make(Opts(/*slots=*/2, /*inflight=*/1, /*chunk=*/16, /*max_seq=*/10));
  Start();
  ASSERT_TRUE(Submit("stop", {5}, 50, {8}).ok());        // 6, 7, 8: ends after the stop token
  ASSERT_TRUE(Submit("seq", {1, 1, 1, 1, 1, 1, 1, 20}, 50).ok());  // 8 prompt tokens + 3 > 10 positions
  RunUntilEnded({"stop", "seq"});
  EXPECT_EQ(Get("stop").tokens, (std::vector<int64_t>{6, 7, 8}));
  EXPECT_EQ(Get("stop").reason, "stop");
  EXPECT_EQ(Get("seq").tokens, (std::vector<int64_t>{21, 22, 23}));  // fed at positions 8, 9; none at 10
  EXPECT_EQ(Get("seq").reason, "max_seq");
  EXPECT_TRUE(absl::IsInvalidArgument(Submit("x", {}, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(Submit("x", std::vector<int64_t>(11, 1), 1)));
  absl::Status vocab = Submit("x", {1, 1000}, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(vocab));
  EXPECT_NE(vocab.message().find("token 1 is 1000, outside the vocabulary [0, 1000)"), std::string::npos) << vocab;
  EXPECT_TRUE(absl::IsInvalidArgument(Submit("x", {1}, 0)));
}

TEST_F(GenerationQueueTest, AMicroBatchTheModelFailsFailsItsSequencesOnly) {
  Make(Opts(/*slots=*/2, /*inflight=*/2, /*chunk=*/8));
  Start();
  ASSERT_TRUE(Submit("a", {1}, 5).ok());
  Sent s;
  ASSERT_TRUE(Answer(&s));  // a's prefill; a is in group 0, decoding
  ASSERT_TRUE(Submit("b", {10}, 5).ok());
  // The next two micro-batches: a's decode and b's prefill (one group each). The one
  // holding b fails in the model.
  Sent x, y;
  for (Sent* n : {&x, &y}) {
    absl::MutexLock lock(&mu_);
    auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !sent_.empty(); };
    ASSERT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&any), absl::Seconds(10)));
    *n = sent_.front();
    sent_.pop_front();
  }
  for (Sent* n : {&x, &y}) {
    ServeResult r;
    r.set_attempt(0);
    r.set_step(n->batch.step());
    if (n->idx[0][0].item<int64_t>() == 10) {
      r.set_ok(false);
      r.set_aborted(true);
      r.set_error("index out of range in self");
    } else {
      r.set_ok(true);
      r.add_tokens(n->idx[0][n->idx.size(1) - 1].item<int64_t>() + 1);
    }
    queue_->OnResult(r);
  }
  RunUntilEnded({"a", "b"});
  EXPECT_TRUE(absl::IsInternal(Get("b").status)) << Get("b").status;
  EXPECT_NE(Get("b").status.message().find("index out of range in self"), std::string::npos);
  EXPECT_TRUE(Get("a").status.ok());
  EXPECT_EQ(Get("a").tokens, (std::vector<int64_t>{2, 3, 4, 5, 6}));
}

TEST_F(GenerationQueueTest, CancelFreesTheSlotAndTheQueueIsBounded) {
  GenerationQueue::Options o = Opts(/*slots=*/1, /*inflight=*/1, /*chunk=*/8);
  o.max_queued = 1;
  Make(o);
  Start();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  ASSERT_TRUE(Submit("long", {1}, 50, {}, cancelled).ok());
  Sent s;
  ASSERT_TRUE(Answer(&s));                             // its prefill: it holds the only slot
  ASSERT_TRUE(Submit("next", {40}, 3).ok());           // waits
  EXPECT_TRUE(absl::IsResourceExhausted(Submit("third", {1}, 1)));
  cancelled->store(true);
  RunUntilEnded({"long", "next"});
  EXPECT_TRUE(absl::IsCancelled(Get("long").status)) << Get("long").status;
  EXPECT_LT(Get("long").tokens.size(), 50u);
  EXPECT_EQ(Get("next").tokens, (std::vector<int64_t>{41, 42, 43}));
  ServingStats st = queue_->Stats();
  EXPECT_EQ(st.generation().failed(), 1);
  EXPECT_EQ(st.generation().slots_in_use(), 0);
}

TEST_F(GenerationQueueTest, ALostPipelineFailsTheSequencesHoldingSlotsAndTheWaitingGoOn) {
  Make(Opts(/*slots=*/1, /*inflight=*/1, /*chunk=*/8));
  Start();
  ASSERT_TRUE(Submit("a", {1}, 10).ok());
  Sent s;
  ASSERT_TRUE(Answer(&s));
  ASSERT_TRUE(Submit("b", {50}, 2).ok());  // waits for the slot
  queue_->Pause(absl::UnavailableError("worker w1 lost"));
  EXPECT_TRUE(absl::IsUnavailable(Get("a").status)) << Get("a").status;
  EXPECT_FALSE(Ended("b"));
  {
    absl::MutexLock lock(&mu_);
    sent_.clear();  // the lost attempt's micro-batches
  }
  queue_->Start(1, {{0, 1, 2}}, [this](const ServeBatch& b, const std::vector<std::string>& inputs) {
    c10::IValue args = torch::jit::pickle_load(std::vector<char>(inputs[0].begin(), inputs[0].end()));
    const auto& e = args.toTupleRef().elements();
    absl::MutexLock lock(&mu_);
    sent_.push_back({b, e[0].toTensor(), e[1].toTensor(), e[2].toTensor()});
    return true;
  });
  for (int i = 0; i < 20 && !Ended("b"); ++i) {
    Sent n;
    ASSERT_TRUE(Answer(&n));
    // Answers of attempt 0 are ignored: re-send as attempt 1.
    ServeResult r;
    r.set_attempt(1);
    r.set_step(n.batch.step());
    r.set_ok(true);
    r.add_tokens(n.idx[0][n.idx.size(1) - 1].item<int64_t>() + 1);
    queue_->OnResult(r);
  }
  EXPECT_EQ(Get("b").tokens, (std::vector<int64_t>{51, 52}));
  queue_->Stop(absl::UnavailableError("stopping"));
  EXPECT_TRUE(absl::IsUnavailable(Submit("c", {1}, 1)));
}

}  // namespace
}  // namespace pippy::coordinator
