#include "coordinator/generation.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/torch_status.h"
#include "coordinator/rank_inputs.h"
#include "pipeline/torchio/model_io.h"
#include "torch/torch.h"

namespace pippy::coordinator {
namespace {

constexpr size_t kWindow = 4096;                      // latencies kept for the percentiles
constexpr absl::Duration kRateWindow = absl::Seconds(10);
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

struct Sequence {
  int64_t id = 0;
  GenerationQueue::Request req;
  GenerationQueue::OnEvent on_event;
  std::shared_ptr<const std::atomic<bool>> cancelled;
  absl::Time arrival;
  absl::Time last_token;
  int slot = -1;             // -1: waiting for one
  int group = 0;             // which of the groups in flight it goes with
  int64_t prefilled = 0;     // prompt tokens in the cache
  std::vector<int64_t> generated;
  bool inflight = false;
  bool finished = false;
  int64_t last_step = -1;    // its last micro-batch (the longest unserved go first)
  double ttft_ms = -1;

  bool Cancelled() const { return cancelled != nullptr && cancelled->load(); }
  bool Prefilling() const { return prefilled < static_cast<int64_t>(req.prompt.size()); }
  int64_t Remaining() const { return static_cast<int64_t>(req.prompt.size()) - prefilled; }
};

struct Row {
  std::shared_ptr<Sequence> seq;
  int64_t length = 1;   // tokens in this row
  bool sample = true;
};

struct Batch {
  std::vector<Row> rows;
  int group = 0;
  bool prefill = false;
  absl::Time sent;
};

// A micro-batch that came back, for the trace.
struct Traced {
  int64_t step = 0;
  bool prefill = false;
  int64_t rows = 0, length = 1;
  absl::Time sent, back;
  double last_stage_seconds = 0;
};
constexpr size_t kTraced = 256;

// p50 and p99 of a window, from one sorted copy.
std::pair<double, double> P50P99(const std::deque<double>& window) {
  if (window.empty()) return {0, 0};
  std::vector<double> v(window.begin(), window.end());
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))]; };
  return {at(0.5), at(0.99)};
}

}  // namespace

struct GenerationQueue::Impl {
  explicit Impl(const Options& o)
      : options(o),
        groups(std::max(1, o.max_inflight)),
        group_inflight(static_cast<size_t>(groups), false),
        group_last_prefill(static_cast<size_t>(groups), false) {
    for (int s = 0; s < o.max_slots; ++s) free_slots.insert(s);
  }

  const Options options;
  const int groups;
  mutable absl::Mutex mu;
  absl::CondVar wake;
  bool stopped ABSL_GUARDED_BY(mu) = false;
  bool exiting ABSL_GUARDED_BY(mu) = false;
  absl::Status stop_reason ABSL_GUARDED_BY(mu);
  bool started ABSL_GUARDED_BY(mu) = false;
  int attempt ABSL_GUARDED_BY(mu) = -1;
  std::vector<std::vector<int>> rank_inputs ABSL_GUARDED_BY(mu);
  Dispatch dispatch ABSL_GUARDED_BY(mu);
  int64_t next_id ABSL_GUARDED_BY(mu) = 1;
  int64_t next_step ABSL_GUARDED_BY(mu) = 0;
  std::deque<std::shared_ptr<Sequence>> waiting ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Sequence>> active ABSL_GUARDED_BY(mu);  // holding a slot, by admission
  std::set<int> free_slots ABSL_GUARDED_BY(mu);
  std::map<int64_t, Batch> inflight ABSL_GUARDED_BY(mu);
  // Per group (max_inflight of them): whether its micro-batch is in the pipeline, and
  // whether its last one was prompt chunks.
  std::vector<bool> group_inflight ABSL_GUARDED_BY(mu);
  std::vector<bool> group_last_prefill ABSL_GUARDED_BY(mu);
  int next_group ABSL_GUARDED_BY(mu) = 0;
  // Counters and windows.
  int64_t sequences ABSL_GUARDED_BY(mu) = 0, failed ABSL_GUARDED_BY(mu) = 0;
  int64_t tokens ABSL_GUARDED_BY(mu) = 0, prompt_tokens ABSL_GUARDED_BY(mu) = 0;
  int64_t prefill_batches ABSL_GUARDED_BY(mu) = 0, decode_batches ABSL_GUARDED_BY(mu) = 0;
  int64_t decode_rows ABSL_GUARDED_BY(mu) = 0;
  std::deque<double> ttft_ms ABSL_GUARDED_BY(mu), itl_ms ABSL_GUARDED_BY(mu);
  std::deque<absl::Time> token_times ABSL_GUARDED_BY(mu);
  metrics::Histogram ttft_seconds ABSL_GUARDED_BY(mu){
      {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  metrics::Histogram itl_seconds ABSL_GUARDED_BY(mu){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  std::deque<Traced> traced ABSL_GUARDED_BY(mu);
  std::thread scheduler;

  using Calls = std::vector<std::pair<OnEvent, Event>>;

  static void Run(Calls& calls) {
    for (auto& [fn, e] : calls) {
      if (fn) fn(std::move(e));
    }
  }
  void RunUnlocked(Calls& calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (calls.empty()) return;
    mu.Unlock();
    Run(calls);
    calls.clear();
    mu.Lock();
  }

  void FreeSlot(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (s.slot < 0) return;
    free_slots.insert(s.slot);
    s.slot = -1;
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](const std::shared_ptr<Sequence>& a) { return a.get() == &s; }),
                 active.end());
  }

  // Ends a sequence (once): its last event, with `status` or done for `reason`.
  void Finish(Sequence& s, absl::Status status, std::string reason, std::vector<int64_t> last_tokens, Calls* calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (s.finished) return;
    s.finished = true;
    ++sequences;
    if (!status.ok()) ++failed;
    FreeSlot(s);
    Event e;
    e.status = std::move(status);
    e.tokens = std::move(last_tokens);
    e.done = e.status.ok();
    e.finish_reason = std::move(reason);
    e.generated = static_cast<int>(s.generated.size());
    e.ttft_ms = s.ttft_ms;
    calls->emplace_back(std::move(s.on_event), std::move(e));
    wake.Signal();  // a slot is free
  }

  // Waiting requests whose clients went away leave the queue.
  void DropCancelledWaiting(Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if ((*it)->Cancelled()) {
        Finish(**it, absl::CancelledError("the client went away"), "", {}, calls);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Requests whose clients went away: those waiting leave the queue, those holding a
  // slot (and not in the pipeline) end now.
  void DropCancelled(Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    DropCancelledWaiting(calls);
    std::vector<std::shared_ptr<Sequence>> gone;
    for (const auto& s : active) {
      if (!s->inflight && s->Cancelled()) gone.push_back(s);
    }
    for (const auto& s : gone) Finish(*s, absl::CancelledError("the client went away"), "", {}, calls);
  }

  void Admit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!waiting.empty() && !free_slots.empty()) {
      std::shared_ptr<Sequence> s = waiting.front();
      waiting.pop_front();
      s->slot = *free_slots.begin();
      free_slots.erase(free_slots.begin());
      s->prefilled = 0;
      s->generated.clear();
      // The smallest group; of those, one not in the pipeline (it can start at once).
      std::vector<int> count = GroupCounts();
      int best = 0;
      for (int g = 1; g < groups; ++g) {
        const size_t a = static_cast<size_t>(g), b = static_cast<size_t>(best);
        if (std::make_pair(count[a], group_inflight[a] ? 1 : 0) < std::make_pair(count[b], group_inflight[b] ? 1 : 0)) {
          best = g;
        }
      }
      s->group = best;
      active.push_back(std::move(s));
    }
  }

  std::vector<int> GroupCounts() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<int> count(static_cast<size_t>(groups), 0);
    for (const auto& a : active) ++count[static_cast<size_t>(a->group)];
    return count;
  }

  // The next micro-batch: of the next group not in the pipeline that has sequences
  // (empty: none). A group's sequences go through the pipeline together (each group
  // is one micro-batch in flight); a group larger than its share gives its newest
  // sequences to the smallest group first, so that the groups stay even as
  // sequences end.
  Batch Form() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Batch b;
    const int64_t n_active = static_cast<int64_t>(active.size());
    const int64_t share = (n_active + groups - 1) / groups;
    for (int k = 0; k < groups; ++k) {
      const int g = (next_group + k) % groups;
      if (group_inflight[static_cast<size_t>(g)]) continue;
      std::vector<int> count = GroupCounts();
      std::vector<std::shared_ptr<Sequence>> members;
      for (const auto& s : active) {
        if (s->group == g && !s->inflight && !s->finished) members.push_back(s);
      }
      while (static_cast<int64_t>(members.size()) > share) {
        int smallest = g;
        for (int h = 0; h < groups; ++h) {
          if (count[static_cast<size_t>(h)] < count[static_cast<size_t>(smallest)]) smallest = h;
        }
        if (count[static_cast<size_t>(smallest)] + 1 >= count[static_cast<size_t>(g)]) break;
        members.back()->group = smallest;
        ++count[static_cast<size_t>(smallest)];
        --count[static_cast<size_t>(g)];
        members.pop_back();
      }
      if (members.empty()) continue;
      std::vector<std::shared_ptr<Sequence>> decodes, prefills;
      for (const auto& s : members) (s->Prefilling() ? prefills : decodes).push_back(s);
      // A group larger than a micro-batch (max_batch) takes turns: longest waiting first.
      auto by_turn = [](const std::shared_ptr<Sequence>& x, const std::shared_ptr<Sequence>& y) {
        return x->last_step < y->last_step;
      };
      std::stable_sort(decodes.begin(), decodes.end(), by_turn);
      std::stable_sort(prefills.begin(), prefills.end(), by_turn);
      const int64_t cap = std::max(1, options.max_batch);
      b.group = g;
      b.prefill = !prefills.empty() && (decodes.empty() || !group_last_prefill[static_cast<size_t>(g)]);
      if (b.prefill) {
        const int64_t chunk = std::max(1, options.prefill_chunk);
        const int64_t L = std::min(chunk, prefills.front()->Remaining());
        const int64_t rows = std::min(cap, std::max<int64_t>(1, chunk / L));
        for (const auto& s : prefills) {
          if (static_cast<int64_t>(b.rows.size()) >= rows) break;
          if (std::min(chunk, s->Remaining()) != L) continue;
          b.rows.push_back({s, L, s->Remaining() == L});
        }
      } else {
        for (const auto& s : decodes) {
          if (static_cast<int64_t>(b.rows.size()) >= cap) break;
          b.rows.push_back({s, 1, true});
        }
      }
      group_last_prefill[static_cast<size_t>(g)] = b.prefill;
      group_inflight[static_cast<size_t>(g)] = true;
      next_group = (g + 1) % groups;
      return b;
    }
    return b;
  }

  // Sends `b` as the next step; the lock is released while it is sent.
  void Send(Batch b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t B = static_cast<int64_t>(b.rows.size());
    const int64_t L = b.rows.front().length;
    ServeBatch meta;
    const int64_t step = next_step++;
    meta.set_step(step);
    meta.set_rows(B);
    meta.set_prefill(b.prefill);
    std::vector<int64_t> idx, pos, slots;
    idx.reserve(static_cast<size_t>(B * L));
    for (const Row& r : b.rows) {
      Sequence& s = *r.seq;
      if (b.prefill) {
        for (int64_t i = 0; i < L; ++i) {
          idx.push_back(s.req.prompt[static_cast<size_t>(s.prefilled + i)]);
          pos.push_back(s.prefilled + i);
        }
      } else {
        idx.push_back(s.generated.back());
        pos.push_back(static_cast<int64_t>(s.req.prompt.size() + s.generated.size()) - 1);
      }
      slots.push_back(s.slot);
      SampleRow* sr = meta.add_sample();
      sr->set_sample(r.sample);
      sr->set_temperature(s.req.temperature);
      sr->set_top_k(s.req.top_k);
      sr->set_top_p(s.req.top_p);
      sr->set_seed(s.req.seed);
      sr->set_token_index(static_cast<int64_t>(s.generated.size()));
      s.inflight = true;
      s.last_step = step;
    }
    if (b.prefill) {
      ++prefill_batches;
    } else {
      ++decode_batches;
      decode_rows += B;
    }
    std::vector<at::Tensor> inputs;
    absl::Status built = TorchCall("building a generation micro-batch", [&] {
      auto opts = torch::TensorOptions().dtype(torch::kLong);
      inputs.push_back(torch::tensor(idx, opts).view({B, L}));
      inputs.push_back(torch::tensor(pos, opts).view({B, L}));
      inputs.push_back(torch::tensor(slots, opts));
    }, absl::StatusCode::kInternal);
    b.sent = absl::Now();
    const Dispatch send = dispatch;
    const std::vector<std::vector<int>> needs = rank_inputs;
    const int sent_attempt = attempt;
    inflight[step] = std::move(b);
    if (!built.ok()) {
      FailBatch(step, built);
      return;
    }
    mu.Unlock();
    const bool ok = send(meta, PickleRankInputs(inputs, needs));
    mu.Lock();
    if (!ok && attempt == sent_attempt) {
      FailBatch(step, absl::UnavailableError("a worker of the generation job is gone; try again once it is SERVING "
                                             "again"));
    }
  }

  void FailBatch(int64_t step, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = inflight.find(step);
    if (it == inflight.end()) return;
    Calls calls;
    for (Row& r : it->second.rows) {
      r.seq->inflight = false;
      Finish(*r.seq, why, "", {}, &calls);
    }
    group_inflight[static_cast<size_t>(it->second.group)] = false;
    inflight.erase(it);
    RunUnlocked(calls);
  }

  // Every sequence holding a slot fails with `why` (its cache is gone).
  void FailActive(const absl::Status& why, Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<std::shared_ptr<Sequence>> all = active;
    for (const auto& s : all) {
      s->inflight = false;
      Finish(*s, why, "", {}, calls);
    }
    inflight.clear();
    std::fill(group_inflight.begin(), group_inflight.end(), false);
  }

  void Loop() {
    absl::MutexLock lock(&mu);
    Calls calls;
    while (!exiting) {
      if (started) {
        DropCancelled(&calls);
        Admit();
        Batch b = Form();  // empty once every group is in the pipeline
        if (!b.rows.empty()) {
          RunUnlocked(calls);
          Send(std::move(b));
          continue;
        }
      } else {
        DropCancelledWaiting(&calls);  // not started: the waiting ones whose clients left still leave
      }
      RunUnlocked(calls);
      if (exiting) break;
      wake.WaitWithTimeout(&mu, kCancelPoll);
    }
  }

  void Observe(Sequence& s, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++tokens;
    token_times.push_back(now);
    while (!token_times.empty() && token_times.front() < now - kRateWindow) token_times.pop_front();
    if (s.generated.size() == 1) {
      s.ttft_ms = Ms(now - s.arrival);
      ttft_ms.push_back(s.ttft_ms);
      if (ttft_ms.size() > kWindow) ttft_ms.pop_front();
      ttft_seconds.Observe(s.ttft_ms / 1000.0);
    } else {
      const double itl = Ms(now - s.last_token);
      itl_ms.push_back(itl);
      if (itl_ms.size() > kWindow) itl_ms.pop_front();
      itl_seconds.Observe(itl / 1000.0);
    }
    s.last_token = now;
  }
};

GenerationQueue::GenerationQueue(const Options& options) : impl_(std::make_unique<Impl>(options)) {
  impl_->scheduler = std::thread([this] { impl_->Loop(); });
}

GenerationQueue::~GenerationQueue() {
  Stop(absl::UnavailableError("the coordinator is stopping"));
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->exiting = true;
    impl_->wake.SignalAll();
  }
  impl_->scheduler.join();
}

absl::StatusOr<std::vector<int64_t>> GenerationQueue::ParsePrompt(const std::string& bytes) {
  absl::StatusOr<c10::IValue> loaded = torchio::PickleLoadUntrusted(bytes, "prompt");
  if (!loaded.ok()) return loaded.status();
  return TorchCall("prompt", [&]() -> absl::StatusOr<std::vector<int64_t>> {
    const c10::IValue& v = *loaded;
    std::vector<int64_t> out;
    if (v.isTensor()) {
      at::Tensor t = v.toTensor();
      if (t.dim() == 2 && t.size(0) == 1) t = t[0];
      if (t.dim() != 1 || !at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
        return absl::InvalidArgumentError(absl::StrCat("prompt: a ", c10::toString(t.scalar_type()), " tensor of shape [",
                                                       absl::StrJoin(t.sizes(), ", "),
                                                       "]; send a 1-D integer tensor of token ids"));
      }
      t = t.to(at::kLong).contiguous();
      out.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
      return out;
    }
    if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (!e.isInt()) {
          return absl::InvalidArgumentError(absl::StrCat("prompt: a list holding a ", e.tagKind(),
                                                         "; send a list of token ids (ints)"));
        }
        out.push_back(e.toInt());
      }
      return out;
    }
    return absl::InvalidArgumentError(absl::StrCat("prompt: a ", v.tagKind(),
                                                   "; send a 1-D integer tensor or a list of token ids"));
  });
}

absl::Status GenerationQueue::Submit(Request request, OnEvent on_event,
                                     std::shared_ptr<const std::atomic<bool>> cancelled) {
  const Options& o = impl_->options;
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt: empty; send at least one token");
  if (static_cast<int64_t>(request.prompt.size()) > o.max_seq) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: ", request.prompt.size(),
                                                   " tokens, more than the job's max_seq (", o.max_seq,
                                                   " positions per sequence); send a shorter prompt"));
  }
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int64_t t = request.prompt[i];
    if (t < 0 || (o.vocab > 0 && t >= o.vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: token ", i, " is ", t, ", outside the vocabulary [0, ",
                                                     o.vocab, ")"));
    }
  }
  if (request.max_new_tokens < 1) return absl::InvalidArgumentError("max_new_tokens: must be at least 1");
  if (!(request.temperature >= 0) || request.temperature > 100) {
    return absl::InvalidArgumentError("temperature: must be in [0, 100] (0: greedy)");
  }
  if (request.top_k < 0) return absl::InvalidArgumentError("top_k: must not be negative (0: all tokens)");
  if (!(request.top_p >= 0) || request.top_p > 1) {
    return absl::InvalidArgumentError("top_p: must be in [0, 1] (0 or 1: all tokens)");
  }
  auto s = std::make_shared<Sequence>();
  s->req = std::move(request);
  s->on_event = std::move(on_event);
  s->cancelled = std::move(cancelled);
  s->arrival = absl::Now();
  absl::MutexLock lock(&impl_->mu);
  if (impl_->stopped) return impl_->stop_reason;
  if (static_cast<int>(impl_->waiting.size()) >= o.max_queued) {
    return absl::ResourceExhaustedError(absl::StrCat(impl_->waiting.size(), " requests wait for a slot already (the "
                                                     "job's --max-queued); try again shortly"));
  }
  s->id = impl_->next_id++;
  impl_->waiting.push_back(std::move(s));
  impl_->wake.Signal();
  return absl::OkStatus();
}

void GenerationQueue::Start(int attempt, std::vector<std::vector<int>> rank_inputs, Dispatch dispatch) {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->stopped) return;
  impl_->attempt = attempt;
  impl_->rank_inputs = std::move(rank_inputs);
  impl_->dispatch = std::move(dispatch);
  impl_->started = true;
  impl_->free_slots.clear();
  for (int s = 0; s < impl_->options.max_slots; ++s) impl_->free_slots.insert(s);
  impl_->wake.Signal();
  log::Info("job={} generating (attempt {}): {} slot(s), {} request(s) waiting", impl_->options.job_id, attempt,
            impl_->options.max_slots, impl_->waiting.size());
}

void GenerationQueue::Pause(const absl::Status& why) {
  Impl::Calls calls;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->started = false;
    impl_->dispatch = nullptr;
    impl_->FailActive(why, &calls);
  }
  Impl::Run(calls);
}

void GenerationQueue::Stop(const absl::Status& why) {
  Impl::Calls calls;
  {
    absl::MutexLock lock(&impl_->mu);
    if (!impl_->stopped) {
      impl_->stopped = true;
      impl_->stop_reason = why;
    }
    impl_->started = false;
    impl_->dispatch = nullptr;
    impl_->FailActive(why, &calls);
    for (auto& s : impl_->waiting) impl_->Finish(*s, why, "", {}, &calls);
    impl_->waiting.clear();
  }
  Impl::Run(calls);
}

void GenerationQueue::OnResult(const ServeResult& result) {
  Impl::Calls calls;
  {
    absl::MutexLock lock(&impl_->mu);
    if (result.attempt() != impl_->attempt) return;
    auto it = impl_->inflight.find(result.step());
    if (it == impl_->inflight.end()) return;
    Batch b = std::move(it->second);
    impl_->inflight.erase(it);
    impl_->group_inflight[static_cast<size_t>(b.group)] = false;
    impl_->wake.Signal();  // room in the pipeline
    impl_->traced.push_back({result.step(), b.prefill, static_cast<int64_t>(b.rows.size()), b.rows.front().length,
                             b.sent, absl::Now(), result.seconds()});
    if (impl_->traced.size() > kTraced) impl_->traced.pop_front();
    const int64_t vocab = impl_->options.vocab;
    absl::Status failed;
    if (!result.ok()) {
      failed = absl::InternalError(absl::StrCat("the model failed on this sequence's micro-batch: ", result.error()));
    } else if (result.tokens_size() != static_cast<int>(b.rows.size())) {
      failed = absl::InternalError(absl::StrCat("the last stage returned ", result.tokens_size(), " tokens for ",
                                                b.rows.size(), " rows"));
    }
    if (!failed.ok()) log::Warn("job={} generation step {}: {}", impl_->options.job_id, result.step(), failed.message());
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < b.rows.size(); ++i) {
      Sequence& s = *b.rows[i].seq;
      s.inflight = false;
      if (s.finished) continue;
      if (!failed.ok()) {
        impl_->Finish(s, failed, "", {}, &calls);
        continue;
      }
      if (b.prefill) {
        s.prefilled += b.rows[i].length;
        impl_->prompt_tokens += b.rows[i].length;
      }
      if (!b.rows[i].sample) continue;
      const int64_t t = result.tokens(static_cast<int>(i));
      if (t < 0 || (vocab > 0 && t >= vocab)) {
        impl_->Finish(s, absl::InternalError(absl::StrCat("the last stage sampled token ", t, ", outside [0, ", vocab,
                                                          ")")),
                      "", {}, &calls);
        continue;
      }
      s.generated.push_back(t);
      impl_->Observe(s, now);
      const auto& stops = s.req.stop_tokens;
      const int64_t total = static_cast<int64_t>(s.req.prompt.size() + s.generated.size());
      if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
        impl_->Finish(s, absl::OkStatus(), "stop", {t}, &calls);
      } else if (static_cast<int>(s.generated.size()) >= s.req.max_new_tokens) {
        impl_->Finish(s, absl::OkStatus(), "length", {t}, &calls);
      } else if (total > impl_->options.max_seq) {
        // Its next token would be fed at position max_seq: the caches end before it.
        impl_->Finish(s, absl::OkStatus(), "max_seq", {t}, &calls);
      } else if (s.Cancelled()) {
        impl_->Finish(s, absl::CancelledError("the client went away"), "", {}, &calls);
      } else {
        Event e;
        e.tokens = {t};
        e.generated = static_cast<int>(s.generated.size());
        e.ttft_ms = s.ttft_ms;
        calls.emplace_back(s.on_event, std::move(e));
      }
    }
  }
  Impl::Run(calls);
}

void GenerationQueue::SetMaxMessageBytes(int64_t bytes) { (void)bytes; }  // token ids only: far below any bound

int64_t GenerationQueue::MessageBudget() const { return 0; }  // ServeBatch.max_output_bytes: no bound

absl::StatusOr<StepTrace> GenerationQueue::Trace(const std::string& job_id) const {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->traced.empty()) {
    return absl::NotFoundError(absl::StrCat("generation job ", job_id, " has sent no micro-batch yet"));
  }
  StepTrace t;
  t.set_job_id(job_id);
  t.set_step(static_cast<int>(impl_->traced.back().step));
  RankTrace* r = t.add_ranks();
  r->set_rank(-1);
  r->set_worker("coordinator");
  std::vector<absl::Time> lane_free;  // when each lane's last micro-batch came back
  for (const Traced& m : impl_->traced) {
    size_t lane = 0;
    while (lane < lane_free.size() && lane_free[lane] > m.sent) ++lane;
    if (lane == lane_free.size()) lane_free.push_back(m.back);
    lane_free[lane] = m.back;
    TraceEvent* e = r->add_events();
    e->set_name(m.prefill ? absl::StrCat("prefill ", m.rows, "x", m.length, " (step ", m.step, ")")
                          : absl::StrCat("decode ", m.rows, " (step ", m.step, ")"));
    e->set_stage(static_cast<int>(lane));
    e->set_begin_us(absl::ToUnixMicros(m.sent));
    e->set_duration_us(absl::ToInt64Microseconds(m.back - m.sent));
    e->set_kind(TRACE_COMPUTE);
  }
  for (size_t lane = 0; lane < lane_free.size(); ++lane) r->add_stages(static_cast<int>(lane));
  return t;
}

metrics::Histogram GenerationQueue::TtftSeconds() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->ttft_seconds;
}

metrics::Histogram GenerationQueue::ItlSeconds() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->itl_seconds;
}

ServingStats GenerationQueue::Stats() const {
  ServingStats s;
  const Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  s.set_requests(m.sequences);
  s.set_failed(m.failed);
  s.set_rows(m.tokens);
  s.set_microbatches(m.prefill_batches + m.decode_batches);
  s.set_queued(static_cast<int>(m.waiting.size()));
  s.set_inflight(static_cast<int>(m.inflight.size()));
  GenerationStats* g = s.mutable_generation();
  g->set_sequences(m.sequences);
  g->set_failed(m.failed);
  g->set_tokens(m.tokens);
  g->set_prompt_tokens(m.prompt_tokens);
  g->set_slots_in_use(static_cast<int>(m.active.size()));
  g->set_max_slots(m.options.max_slots);
  g->set_waiting(static_cast<int>(m.waiting.size()));
  const absl::Time now = absl::Now();
  int64_t recent = 0;
  for (const absl::Time& t : m.token_times) recent += t >= now - kRateWindow ? 1 : 0;
  if (!m.token_times.empty()) {
    const double span = std::max(0.001, absl::ToDoubleSeconds(std::min(kRateWindow, now - m.token_times.front())));
    g->set_tokens_per_second(static_cast<double>(recent) / span);
  }
  const auto [ttft50, ttft99] = P50P99(m.ttft_ms);
  const auto [itl50, itl99] = P50P99(m.itl_ms);
  g->set_ttft_p50_ms(ttft50);
  g->set_ttft_p99_ms(ttft99);
  g->set_itl_p50_ms(itl50);
  g->set_itl_p99_ms(itl99);
  g->set_prefill_microbatches(m.prefill_batches);
  g->set_decode_microbatches(m.decode_batches);
  g->set_mean_decode_rows(m.decode_batches > 0 ? static_cast<double>(m.decode_rows) / m.decode_batches : 0);
  s.set_mean_batch_rows(g->mean_decode_rows());
  return s;
}

}  // namespace pippy::coordinator
