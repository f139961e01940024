#include "coordinator/serving.h"

#include "coordinator/rank_inputs.h"

#include <algorithm>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/transport/transport.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/script.h"

namespace pippy::coordinator {
namespace {

constexpr size_t kLatencyWindow = 4096;

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

struct Request {
  int64_t id = 0;
  std::vector<at::Tensor> inputs;
  int64_t rows = 0;
  std::string bucket;            // where it waits (its shape's, or its own once it goes alone)
  absl::Time arrival;
  ServingQueue::Done done;
  std::shared_ptr<const std::atomic<bool>> cancelled;  // the client went away
  bool finished = false;
  bool solo = false;             // sent alone after a shared micro-batch failed
  int generation = 0;            // parts of an earlier try are ignored
  int64_t queued_to = 0;         // rows [0, queued_to) are in micro-batches
  int64_t row_bytes = 0;         // bytes of one row of its inputs (all arguments)

  // Nothing of it has left yet and its client is gone: it need not be computed.
  bool Abandoned() const { return queued_to == 0 && cancelled != nullptr && cancelled->load(); }
  int64_t rows_done = 0;
  std::map<int64_t, c10::IValue> parts;  // first row -> those rows of the output
  double queue_ms = -1;
  double pipeline_ms = 0;
  int microbatch_rows = 0;
};

struct Segment {
  std::shared_ptr<Request> request;
  int generation = 0;
  int64_t begin = 0, end = 0;
};

struct Inflight {
  std::vector<Segment> segments;
  absl::Time sent;
  int64_t rows = 0;
  int64_t bytes = 0;  // of its inputs' tensors
};

// Rows [begin, end) of an output: tensors along dim 0, tuples and lists element-wise;
// anything else is the micro-batch's as a whole.
c10::IValue SliceRows(const c10::IValue& v, int64_t begin, int64_t end) {
  return transport::MapTensors(v, [&](const at::Tensor& t) {
    return t.dim() == 0 ? t : t.narrow(0, begin, end - begin).clone();
  });
}

std::string BucketOf(const std::vector<at::Tensor>& inputs) {
  std::vector<std::string> parts;
  for (const at::Tensor& t : inputs) {
    std::vector<int64_t> rest(t.sizes().begin() + 1, t.sizes().end());
    parts.push_back(absl::StrCat(torchio::DtypeName(t.scalar_type()), "[", absl::StrJoin(rest, ","), "]"));
  }
  return absl::StrJoin(parts, ";");
}

}  // namespace

std::vector<std::string> PickleRankInputs(const std::vector<at::Tensor>& batch,
                                          const std::vector<std::vector<int>>& needs) {
  std::vector<std::string> per_rank(needs.size());
  for (size_t r = 0; r < needs.size(); ++r) {
    if (needs[r].empty()) continue;
    std::vector<c10::IValue> args(batch.size());
    for (int i : needs[r]) args[static_cast<size_t>(i)] = batch[static_cast<size_t>(i)];
    std::vector<char> bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(args)));
    per_rank[r].assign(bytes.data(), bytes.size());
  }
  return per_rank;
}

struct ServingQueue::Impl {
  explicit Impl(const Options& o) : options(o), max_message_bytes(o.max_message_bytes) {}

  const Options options;
  mutable absl::Mutex mu;
  int64_t max_message_bytes ABSL_GUARDED_BY(mu);  // options' unless SetMaxMessageBytes
  absl::CondVar wake;
  bool stopped ABSL_GUARDED_BY(mu) = false;    // refuses requests
  bool exiting ABSL_GUARDED_BY(mu) = false;    // the batcher ends
  absl::Status stop_reason ABSL_GUARDED_BY(mu);
  bool started ABSL_GUARDED_BY(mu) = false;
  int attempt ABSL_GUARDED_BY(mu) = -1;
  std::vector<std::vector<int>> rank_inputs ABSL_GUARDED_BY(mu);
  Dispatch dispatch ABSL_GUARDED_BY(mu);
  int64_t next_id ABSL_GUARDED_BY(mu) = 1;
  int64_t next_step ABSL_GUARDED_BY(mu) = 0;
  int unfinished ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, std::deque<std::shared_ptr<Request>>> buckets ABSL_GUARDED_BY(mu);
  std::map<int64_t, Inflight> inflight ABSL_GUARDED_BY(mu);
  // Counters and the latency window.
  int64_t requests ABSL_GUARDED_BY(mu) = 0, failed ABSL_GUARDED_BY(mu) = 0, rows ABSL_GUARDED_BY(mu) = 0;
  int64_t microbatches ABSL_GUARDED_BY(mu) = 0, microbatch_rows ABSL_GUARDED_BY(mu) = 0;
  std::deque<std::pair<absl::Time, double>> latencies ABSL_GUARDED_BY(mu);  // answered at, ms
  metrics::Histogram latency_seconds ABSL_GUARDED_BY(mu){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  std::thread batcher;

  using Calls = std::vector<std::pair<Done, Answer>>;

  // Ends a request (once); its callback goes into `calls`, run after the lock is released.
  void Complete(Request& r, Answer a, Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (r.finished) return;
    r.finished = true;
    --unfinished;
    ++requests;
    if (a.status.ok()) {
      rows += r.rows;
    } else {
      ++failed;
    }
    const absl::Time now = absl::Now();
    latencies.emplace_back(now, Ms(now - r.arrival));
    latency_seconds.Observe(absl::ToDoubleSeconds(now - r.arrival));
    while (latencies.size() > kLatencyWindow) latencies.pop_front();
    a.rows = r.rows;
    a.queue_ms = std::max(0.0, r.queue_ms);
    a.pipeline_ms = r.pipeline_ms;
    a.microbatch_rows = r.microbatch_rows;
    calls->emplace_back(std::move(r.done), std::move(a));
    r.inputs.clear();
    r.parts.clear();
  }

  void FailInflight(const absl::Status& why, Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& [step, f] : inflight) {
      for (Segment& s : f.segments) {
        if (s.generation == s.request->generation) Complete(*s.request, Answer{why}, calls);
      }
    }
    inflight.clear();
  }

  static void Run(Calls& calls) {
    for (auto& [done, answer] : calls) {
      if (done) done(std::move(answer));
    }
  }

  // What a micro-batch's tensors may take: the message bound less room for the rest of
  // the message (pickle framing, ids).
  int64_t MessageBudget() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return std::max<int64_t>(max_message_bytes - (int64_t{64} << 10), 1);
  }

  // The bucket to send now, if any (the one whose oldest request came first among
  // those full or due); else when the next one is due.
  std::string Pick(absl::Time now, bool only_full, absl::Time* next_due) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::string pick;
    absl::Time pick_arrival = absl::InfiniteFuture();
    for (auto it = buckets.begin(); it != buckets.end();) {
      auto& q = it->second;
      while (!q.empty() && (q.front()->finished || q.front()->bucket != it->first)) q.pop_front();
      if (q.empty()) {
        it = buckets.erase(it);
        continue;
      }
      // Full: max_batch rows, or as many bytes as a micro-batch may carry.
      int64_t waiting = 0, waiting_bytes = 0;
      for (const auto& r : q) {
        if (!r->finished && r->bucket == it->first && !r->Abandoned()) {
          waiting += r->rows - r->queued_to;
          waiting_bytes += (r->rows - r->queued_to) * r->row_bytes;
        }
        if (waiting >= options.max_batch || waiting_bytes >= MessageBudget()) break;
      }
      const bool full = waiting >= options.max_batch || waiting_bytes >= MessageBudget();
      const absl::Time due = q.front()->arrival + options.max_delay;
      if (full || (!only_full && (due <= now || q.front()->solo))) {
        if (q.front()->arrival < pick_arrival) {
          pick = it->first;
          pick_arrival = q.front()->arrival;
        }
      } else if (!only_full) {
        *next_due = std::min(*next_due, due);
      }
      ++it;
    }
    return pick;
  }

  // Takes up to max_batch rows from bucket `pick`, oldest request first; requests whose
  // client went away are dropped into `dropped`.
  Inflight TakeRows(const std::string& pick, Calls* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Inflight f;
    auto& q = buckets[pick];
    while (!q.empty() && f.rows < options.max_batch) {
      std::shared_ptr<Request> r = q.front();
      if (r->finished || r->bucket != pick) {
        q.pop_front();
        continue;
      }
      if (r->Abandoned()) {
        Complete(*r, Answer{absl::CancelledError("the client went away before its request was sent")}, dropped);
        q.pop_front();
        continue;
      }
      // Rows up to max_batch, and bytes up to the message bound (one row at least:
      // Submit refused requests one row of which is larger).
      const int64_t fit = r->row_bytes > 0 ? (MessageBudget() - f.bytes) / r->row_bytes : r->rows;
      const int64_t n = std::min({r->rows - r->queued_to, options.max_batch - f.rows, fit});
      if (n <= 0) break;  // full by bytes: it goes first in the next micro-batch
      f.segments.push_back({r, r->generation, r->queued_to, r->queued_to + n});
      r->queued_to += n;
      f.rows += n;
      f.bytes += n * r->row_bytes;
      if (r->queued_to == r->rows) q.pop_front();
      if (r->solo) break;  // alone: nothing shares its micro-batch
    }
    return f;
  }

  // Runs `calls` with the lock released.
  void RunUnlocked(Calls& calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (calls.empty()) return;
    mu.Unlock();
    Run(calls);
    mu.Lock();
  }

  // Builds micro-batch `f` (copies of its requests' rows) and sends it to every rank as
  // the next step; the lock is released while it is sent. A send that fails (a rank's
  // stream gone) fails its requests with UNAVAILABLE.
  void Send(Inflight f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const absl::Time now = absl::Now();
    f.sent = now;
    for (Segment& s : f.segments) {
      if (s.request->queue_ms < 0) s.request->queue_ms = Ms(now - s.request->arrival);
      s.request->microbatch_rows = static_cast<int>(f.rows);
    }
    std::vector<at::Tensor> batch;
    absl::Status built = TorchCall("building a micro-batch", [&] {
      for (size_t i = 0; i < options.input_names.size(); ++i) {
        std::vector<at::Tensor> pieces;
        for (const Segment& s : f.segments) pieces.push_back(s.request->inputs[i].narrow(0, s.begin, s.end - s.begin));
        batch.push_back(pieces.size() == 1 ? pieces[0].clone() : at::cat(pieces, 0));
      }
    });
    const int64_t step = next_step++;
    const int64_t rows_sent = f.rows;
    ++microbatches;
    microbatch_rows += rows_sent;
    if (!built.ok()) {
      Calls calls;
      for (Segment& s : f.segments) Complete(*s.request, Answer{absl::InternalError(built.message())}, &calls);
      RunUnlocked(calls);
      return;
    }
    inflight[step] = std::move(f);
    const Dispatch send = dispatch;
    const std::vector<std::vector<int>> needs = rank_inputs;
    const int sent_attempt = attempt;
    mu.Unlock();
    ServeBatch b;
    b.set_step(step);
    b.set_rows(rows_sent);
    const bool ok = send(b, PickleRankInputs(batch, needs));
    mu.Lock();
    if (ok || attempt != sent_attempt) return;
    auto it = inflight.find(step);
    if (it == inflight.end()) return;
    Calls calls;
    for (Segment& s : it->second.segments) {
      if (s.generation == s.request->generation) {
        Complete(*s.request,
                 Answer{absl::UnavailableError("a worker of the serving job is gone; try again once it is SERVING "
                                               "again")},
                 &calls);
      }
    }
    inflight.erase(it);
    RunUnlocked(calls);
  }

  // The batcher thread: forms micro-batches as they are due and sends them in order.
  void Loop() {
    absl::MutexLock lock(&mu);
    while (!exiting) {
      absl::Time next_due = absl::InfiniteFuture();
      std::string pick;
      if (started && static_cast<int>(inflight.size()) < options.max_inflight) {
        // Beyond one micro-batch per stage, only full ones go.
        const bool only_full = static_cast<int>(inflight.size()) >= std::min(options.stages, options.max_inflight);
        pick = Pick(absl::Now(), only_full, &next_due);
      }
      if (pick.empty()) {
        if (next_due == absl::InfiniteFuture()) {
          wake.WaitWithTimeout(&mu, absl::Seconds(1));
        } else {
          wake.WaitWithDeadline(&mu, next_due);
        }
        continue;
      }
      Calls dropped;
      Inflight f = TakeRows(pick, &dropped);
      RunUnlocked(dropped);
      if (!f.segments.empty()) Send(std::move(f));
    }
  }
};

ServingQueue::ServingQueue(const Options& options) : impl_(std::make_unique<Impl>(options)) {
  impl_->batcher = std::thread([this] { impl_->Loop(); });
}

ServingQueue::~ServingQueue() {
  Stop(absl::UnavailableError("the coordinator is stopping"));
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->exiting = true;
    impl_->wake.SignalAll();
  }
  impl_->batcher.join();
}

absl::Status ServingQueue::Submit(std::string input, Done done, std::shared_ptr<const std::atomic<bool>> cancelled) {
  const Options& o = impl_->options;
  auto r = std::make_shared<Request>();
  r->arrival = absl::Now();
  absl::StatusOr<c10::IValue> loaded = torchio::PickleLoadUntrusted(input, "input");
  std::string().swap(input);
  if (!loaded.ok()) return loaded.status();
  absl::Status checked = TorchCall("input", [&]() -> absl::Status {
    c10::IValue value = *loaded;
    if (value.isGenericDict()) {
      auto dict = value.toGenericDict();
      auto it = dict.find(std::string("inputs"));
      if (it != dict.end()) value = it->value();  // a whole data file
    }
    PIPPY_ASSIGN_OR_RETURN(std::vector<c10::IValue> args, torchio::ToForwardArguments(value, o.input_names, "input"));
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string name = absl::StrCat("input '", o.input_names[i], "'");
      if (!args[i].isTensor()) {
        return absl::InvalidArgumentError(absl::StrCat(name, " is a ", args[i].tagKind(),
                                                       "; serving takes a tensor per argument, with the request's "
                                                       "rows along dim 0"));
      }
      at::Tensor t = args[i].toTensor();
      PIPPY_RETURN_IF_ERROR(torchio::CheckRowTensor(t, name));
      const std::string dtype = torchio::DtypeName(t.scalar_type());
      if (i < o.input_dtypes.size() && !o.input_dtypes[i].empty() && dtype != o.input_dtypes[i]) {
        return absl::InvalidArgumentError(absl::StrCat(name, " is ", dtype, " but the model takes ", o.input_dtypes[i],
                                                       " (as the example input was); convert it"));
      }
      if (i < o.input_dims.size() && o.input_dims[i] >= 0 && t.dim() != o.input_dims[i]) {
        return absl::InvalidArgumentError(absl::StrCat(name, " has ", t.dim(), " dimensions (shape [",
                                                       absl::StrJoin(t.sizes(), ", "), "]) but the model takes ",
                                                       o.input_dims[i], " (rows first), as the example input had"));
      }
      if (t.size(0) == 0) return absl::InvalidArgumentError(absl::StrCat(name, " has no rows"));
      if (i > 0 && t.size(0) != r->rows) {
        return absl::InvalidArgumentError(absl::StrCat(name, " has ", t.size(0), " rows but input '", o.input_names[0],
                                                       "' has ", r->rows));
      }
      r->rows = t.size(0);
      r->inputs.push_back(t.contiguous());
    }
    if (r->inputs.empty()) return absl::InvalidArgumentError("input: forward() takes no arguments to batch");
    for (const at::Tensor& t : r->inputs) r->row_bytes += static_cast<int64_t>(t.nbytes()) / r->rows;
    return absl::OkStatus();
  });
  if (!checked.ok()) {
    return absl::Status(checked.code() == absl::StatusCode::kInternal ? absl::StatusCode::kInvalidArgument : checked.code(),
                        checked.message());
  }
  r->bucket = BucketOf(r->inputs);
  r->done = std::move(done);
  r->cancelled = std::move(cancelled);
  absl::MutexLock lock(&impl_->mu);
  if (impl_->stopped) return impl_->stop_reason;
  if (r->row_bytes > impl_->MessageBudget()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "input: one row of this request holds ", r->row_bytes, " bytes of tensors, more than a micro-batch may carry (",
        impl_->MessageBudget(), " bytes: the coordinator's --max-message-mib less framing); send smaller rows"));
  }
  if (impl_->unfinished >= o.max_queued) {
    return absl::ResourceExhaustedError(absl::StrCat(impl_->unfinished, " requests wait already (the serving job's "
                                                     "limit); try again shortly"));
  }
  r->id = impl_->next_id++;
  ++impl_->unfinished;
  impl_->buckets[r->bucket].push_back(std::move(r));
  impl_->wake.Signal();
  return absl::OkStatus();
}

void ServingQueue::Start(int attempt, std::vector<std::vector<int>> rank_inputs, Dispatch dispatch) {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->stopped) return;
  impl_->attempt = attempt;
  impl_->rank_inputs = std::move(rank_inputs);
  impl_->dispatch = std::move(dispatch);
  impl_->started = true;
  impl_->wake.Signal();
  log::Info("job={} serving (attempt {}): {} request(s) waiting", impl_->options.job_id, attempt, impl_->unfinished);
}

void ServingQueue::Pause(const absl::Status& why) {
  Impl::Calls calls;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->started = false;
    impl_->dispatch = nullptr;
    impl_->FailInflight(why, &calls);
  }
  Impl::Run(calls);
}

void ServingQueue::Stop(const absl::Status& why) {
  Impl::Calls calls;
  {
    absl::MutexLock lock(&impl_->mu);
    if (!impl_->stopped) {
      impl_->stopped = true;
      impl_->stop_reason = why;
    }
    impl_->started = false;
    impl_->dispatch = nullptr;
    impl_->FailInflight(why, &calls);
    for (auto& [key, q] : impl_->buckets) {
      for (auto& r : q) impl_->Complete(*r, Answer{why}, &calls);
    }
    impl_->buckets.clear();
  }
  Impl::Run(calls);
}

void ServingQueue::OnResult(const ServeResult& result) {
  Inflight f;
  {
    absl::MutexLock lock(&impl_->mu);
    if (result.attempt() != impl_->attempt) return;
    auto it = impl_->inflight.find(result.step());
    if (it == impl_->inflight.end()) return;
    f = std::move(it->second);
    impl_->inflight.erase(it);
    impl_->wake.Signal();  // room in the pipeline
  }
  const double pipeline_ms = Ms(absl::Now() - f.sent);
  absl::StatusOr<c10::IValue> output = absl::UnavailableError(
      absl::StrCat("the pipeline failed on this request's micro-batch: ", result.error()));
  if (result.ok()) {
    output = torchio::PickleLoad(result.output(), "a serving output");
    if (!output.ok()) output = absl::InternalError(output.status().message());
  }
  // Slices and answers are made outside the lock; the requests' state is updated in it.
  std::vector<c10::IValue> slices(f.segments.size());
  if (output.ok()) {
    int64_t offset = 0;
    absl::Status sliced = TorchCall("slicing a serving output", [&] {
      for (size_t i = 0; i < f.segments.size(); ++i) {
        const int64_t n = f.segments[i].end - f.segments[i].begin;
        slices[i] = SliceRows(*output, offset, offset + n);
        offset += n;
      }
    }, absl::StatusCode::kInternal);
    if (!sliced.ok()) output = sliced;
  }
  Impl::Calls calls;
  absl::MutexLock lock(&impl_->mu);
  std::vector<std::shared_ptr<Request>> live;
  for (const Segment& s : f.segments) {
    if (s.generation == s.request->generation && !s.request->finished &&
        std::find(live.begin(), live.end(), s.request) == live.end()) {
      live.push_back(s.request);
    }
  }
  if (output.ok()) {
    for (size_t i = 0; i < f.segments.size(); ++i) {
      Request& r = *f.segments[i].request;
      if (f.segments[i].generation != r.generation || r.finished) continue;
      r.parts[f.segments[i].begin] = std::move(slices[i]);
      r.rows_done += f.segments[i].end - f.segments[i].begin;
      r.pipeline_ms = std::max(r.pipeline_ms, pipeline_ms);
      if (r.rows_done < r.rows) continue;
      std::vector<c10::IValue> parts;
      for (auto& [begin, v] : r.parts) parts.push_back(std::move(v));
      Answer a;
      absl::Status merged = TorchCall("merging a request's output", [&]() -> absl::Status {
        c10::IValue whole = parts[0];
        if (parts.size() > 1) {
          PIPPY_ASSIGN_OR_RETURN(whole, stage::MergeMicrobatches(parts));
        }
        std::vector<char> bytes = torch::jit::pickle_save(whole);
        a.output.assign(bytes.data(), bytes.size());
        return absl::OkStatus();
      }, absl::StatusCode::kInternal);
      a.status = merged;
      impl_->Complete(r, std::move(a), &calls);
    }
  } else if ((result.aborted() || result.too_large()) &&
             (live.size() > 1 || (live.size() == 1 && !live[0]->solo))) {
    // One of them does not fit the model: each goes again alone. A single live request
    // that was not alone goes again too: the culprit may be a stale segment of a request
    // already sent alone (split over two micro-batches), not this one.
    for (auto& r : live) {
      ++r->generation;
      r->solo = true;
      r->queued_to = 0;
      r->rows_done = 0;
      r->parts.clear();
      r->bucket = absl::StrCat("#", r->id);
      impl_->buckets[r->bucket].push_back(r);
    }
    log::Info("job={} micro-batch {} of {} requests failed {} ({}); sending each alone", impl_->options.job_id,
              result.step(), live.size(), result.too_large() ? "by its output's size" : "in the model", result.error());
    impl_->wake.Signal();
  } else {
    const absl::Status why =
        result.too_large()
            ? absl::ResourceExhaustedError(absl::StrCat("output: ", result.error(), "; send fewer rows per request"))
        : result.aborted()
            ? absl::InvalidArgumentError(absl::StrCat("input: the model failed on this request: ", result.error()))
            : output.status();
    for (auto& r : live) impl_->Complete(*r, Answer{why}, &calls);
  }
  impl_->mu.Unlock();
  Impl::Run(calls);
  impl_->mu.Lock();
}

void ServingQueue::SetMaxMessageBytes(int64_t bytes) {
  absl::MutexLock lock(&impl_->mu);
  impl_->max_message_bytes = bytes;
}

int64_t ServingQueue::MessageBudget() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->MessageBudget();
}

metrics::Histogram ServingQueue::LatencySeconds() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->latency_seconds;
}

ServingStats ServingQueue::Stats() const {
  ServingStats s;
  absl::MutexLock lock(&impl_->mu);
  s.set_requests(impl_->requests);
  s.set_failed(impl_->failed);
  s.set_rows(impl_->rows);
  s.set_microbatches(impl_->microbatches);
  s.set_mean_batch_rows(impl_->microbatches > 0 ? static_cast<double>(impl_->microbatch_rows) / impl_->microbatches : 0);
  s.set_queued(impl_->unfinished);
  s.set_inflight(static_cast<int>(impl_->inflight.size()));
  if (!impl_->latencies.empty()) {
    std::vector<double> ms;
    for (const auto& [t, l] : impl_->latencies) ms.push_back(l);
    std::sort(ms.begin(), ms.end());
    auto at = [&](double q) { return ms[std::min(ms.size() - 1, static_cast<size_t>(q * static_cast<double>(ms.size())))]; };
    s.set_p50_ms(at(0.5));
    s.set_p99_ms(at(0.99));
    const double span = absl::ToDoubleSeconds(impl_->latencies.back().first - impl_->latencies.front().first);
    if (span > 0) s.set_requests_per_second(static_cast<double>(impl_->latencies.size() - 1) / span);
  }
  return s;
}

}  // namespace pippy::coordinator
