// pippyctl's commands that talk to a coordinator: submit, list, status, watch, cancel,
// fetch, workers. Files travel in 1 MiB chunks in both directions, read from and
// written to disk as they go: pippyctl's memory does not grow with the model.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/commands.h"
#include "client/table.h"
#include "common/cli.h"
#include "common/proto_json.h"
#include "common/tls.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "pipeline/autoplan/chooser.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/job_state.h"

namespace pippy::cli {
namespace {

constexpr size_t kChunk = 1 << 20;

absl::Status FromGrpc(const grpc::Status& s, const std::string& coordinator) {
  if (s.ok()) return absl::OkStatus();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", coordinator, " (", s.error_message(),
                                               "); start one (pippyctl local) or set --coordinator / PIPPY_COORDINATOR"));
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string Json(const google::protobuf::Message& m) { return ProtoToJson(m); }

// A refusal of a submission in the words the user typed: the API's messages name the
// spec's fields (right for programs and the Python client); pippyctl names its flags
// and the files given (the coordinator calls the uploads 'model' and 'data').
absl::Status InCliWords(const absl::Status& s, const std::string& model, const std::string& data) {
  if (s.ok()) return s;
  // Dotted and snake_case names are unambiguous anywhere; one-word fields only where
  // they lead the message ("steps: must be at least 1").
  static const std::pair<const char*, const char*> kAnywhere[] = {
      {"split: give split.stages or split.split_at", "give --stages or --split-at"},
      {"schedule.microbatches", "--microbatches"},
      {"schedule.stages_per_worker", "--stages-per-worker"},
      {"schedule.kind", "--schedule"},
      {"split.stages", "--stages"},
      {"auto_plan", "auto"},
      {"split.split_at", "--split-at"},
      {"split.balance", "--balance"},
      {"serving.max_batch", "--max-batch"},
      {"serving.max_delay_ms", "--max-delay-ms"},
      {"serving.max_inflight", "--max-inflight"},
      {"optimizer.kind", "--optimizer"},
      {"optimizer.lr", "--lr"},
      {"optimizer.momentum", "--momentum"},
      {"optimizer.weight_decay", "--weight-decay"},
      {"optimizer.beta1", "--beta1"},
      {"optimizer.beta2", "--beta2"},
      {"optimizer.eps", "--eps"},
      {"optimizer.clip_grad_norm", "--clip-grad-norm"},
      {"optimizer.lr_schedule", "--lr-schedule"},
      {"optimizer.warmup_steps", "--warmup-steps"},
      {"optimizer.min_lr", "--min-lr"},
      {"fault_tolerance.checkpoint_every", "--checkpoint-every"},
      {"fault_tolerance.max_restarts", "--max-restarts"},
      {"fault_tolerance.recovery_timeout_s", "--recovery-timeout-s"},
      {"data.synthetic", "--synthetic"},
      {"data.dataset.path", "--dataset"},
      {"data.dataset.seq_len", "--seq-len"},
      {"data.dataset.token_dtype", "--token-dtype"},
      {"data.dataset", "--dataset"},
      {"resume_from", "--resume-from"},
      {"eval.dataset.path", "--eval-dataset"},
      {"eval.dataset", "--eval-dataset"},
      {"eval.every", "--eval-every"},
      {"eval.batches", "--eval-batches"},
      {"batch_size", "--batch-size"},
  };
  static const std::pair<const char*, const char*> kLeading[] = {
      {"steps: ", "--steps: "},     {"epochs: ", "--epochs: "},     {"replicas: ", "--replicas: "}, {"precision: ", "--dtype: "},
      {"loss: ", "--loss: "},       {"split: ", "--stages/--split-at: "},
  };
  std::string m(s.message());
  for (const auto& [from, to] : kAnywhere) m = absl::StrReplaceAll(m, {{from, to}});
  for (const auto& [from, to] : kLeading) {
    if (absl::StartsWith(m, from)) m = absl::StrCat(to, m.substr(std::strlen(from)));
  }
  const std::string model_name = std::filesystem::path(model).filename().string();
  m = absl::StrReplaceAll(m, {{"model: 'model'", absl::StrCat("model: '", model_name, "'")},
                              {"loading 'model'", absl::StrCat("loading '", model_name, "'")}});
  if (!data.empty()) {
    const std::string data_name = std::filesystem::path(data).filename().string();
    m = absl::StrReplaceAll(m, {{"data: 'data'", absl::StrCat("data: '", data_name, "'")}});
  }
  return absl::Status(s.code(), m);
}

// Plain or TLS (--tls-ca) credentials; a bad --tls-ca file was refused when the flags
// were parsed, so failing here means it is not PEM: exit 2 with the reason.
std::shared_ptr<grpc::ChannelCredentials> Credentials(const GlobalFlags& g) {
  auto c = tls::ChannelCredentials({g.tls_ca, "", ""});
  if (!c.ok()) std::exit(Fail(kProgram, c.status()));
  return *c;
}

// The user's token (--token-file or PIPPY_TOKEN) on every call: "authorization: Bearer T".
void Authorize(grpc::ClientContext* ctx, const GlobalFlags& g) {
  static const std::string token = [&g] {
    std::string t;
    if (!g.token_file.empty()) {
      std::ifstream in(g.token_file);
      std::getline(in, t);
    } else if (const char* env = std::getenv("PIPPY_TOKEN")) {
      t = env;
    }
    while (!t.empty() && (t.back() == '\r' || t.back() == ' ' || t.back() == '\n')) t.pop_back();
    return t;
  }();
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

// `bulk_receive`: for a command that receives a large file (fetch), whose writes to
// disk can stall while the coordinator keeps sending. gRPC's BDP probe then grows the
// stream's receive window (and the bytes it holds for the stalled reader) to tens of
// MiB: fetch peaked at 154-179 MiB in 1 of 8-9 fetches of 2-4 GiB (memory_bench).
// A fixed 8 MiB window bounds it; 8 MiB in flight still fills a fast link.
std::unique_ptr<Coordinator::Stub> Connect(const GlobalFlags& g, bool bulk_receive = false) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (bulk_receive) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20);
  }
  // Dial again quickly after the coordinator went away (watch follows it through a restart).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return Coordinator::NewStub(grpc::CreateCustomChannel(g.coordinator, Credentials(g), args));
}

// The first line of `text`, cut to `width` characters ("..." where cut): what a table
// cell or a heading shows of a reason that may be a whole traceback.
std::string FirstLine(const std::string& text, size_t width) {
  std::string line = text.substr(0, text.find('\n'));
  const bool more = line.size() < text.size();
  if (line.size() > width) {
    line = line.substr(0, width - 3) + "...";
  } else if (more) {
    line += " ...";
  }
  return line;
}

void PrintJob(const Job& j) {
  std::cout << "job " << j.job_id() << " (" << j.spec().name() << "): " << JobState_Name(j.state());
  if (!j.reason().empty()) std::cout << " — " << FirstLine(j.reason(), 160);
  std::cout << "\n  " << job::ModeName(j.spec().mode()) << ", schedule " << job::ScheduleName(j.spec().schedule().kind())
            << ", " << job::PrecisionName(j.spec().precision()) << ", " << j.plan().stages_size()
            << (j.plan().stages_size() == 1 ? " stage on " : " stages on ") << j.workers_size()
            << (j.workers_size() == 1 ? " worker" : " workers") << ", step " << j.step()
            << "/" << j.spec().steps();
  if (j.losses_size() > 0) std::cout << ", loss " << absl::StrFormat("%.4f", j.losses(j.losses_size() - 1));
  if (j.learning_rates_size() > 0) {
    std::cout << ", lr " << absl::StrFormat("%.4g", j.learning_rates(j.learning_rates_size() - 1));
  }
  if (j.samples_per_second() > 0) {
    std::cout << absl::StrFormat(", %.0f samples/s, bubble %.0f%%", j.samples_per_second(), 100 * j.bubble_fraction());
  }
  if (const PlanChoice& c = j.plan().choice(); c.candidates_size() > 0) {
    // What auto chose, and the prediction beside the measurement.
    const PlanCandidate& w = c.candidates(0);
    std::cout << "\n  auto plan (" << absl::StrJoin(c.chosen(), ", ") << "): " << job::ScheduleName(w.schedule())
              << ", " << w.microbatches() << " micro-batches, " << w.stages() << " stages on " << w.workers()
              << " workers";
    if (!c.fallback().empty()) {
      std::cout << ", the defaults (costs not measured: " << FirstLine(c.fallback(), 120) << ")";
    } else {
      std::cout << absl::StrFormat("; predicted %.1f samples/s", w.samples_per_second());
      if (j.samples_per_second() > 0) {
        std::cout << absl::StrFormat(", measured %.1f (%.2fx)", j.samples_per_second(),
                                     j.samples_per_second() / w.samples_per_second());
      }
      std::cout << " (" << c.candidates_size() << " candidates; submit --explain lists them)";
    }
  }
  if (j.losses_size() > 1 || j.evals_size() > 0) {
    // Both curves, compactly: at most 8 points of the training loss (evenly spaced, the
    // last included) and the last 8 evaluations.
    std::vector<std::string> train, eval;
    const int n = j.losses_size(), points = std::min(n, 8);
    for (int k = 0; k < points; ++k) {
      const int at = points == 1 ? n - 1 : static_cast<int>(static_cast<int64_t>(k) * (n - 1) / (points - 1));
      train.push_back(absl::StrFormat("%.4g@%d", j.losses(at), at + 1));
    }
    for (int k = std::max(0, j.evals_size() - 8); k < j.evals_size(); ++k) {
      eval.push_back(absl::StrFormat("%.4g@%d", j.evals(k).loss(), j.evals(k).step()));
    }
    if (!train.empty()) std::cout << "\n  train loss " << absl::StrJoin(train, " ");
    if (!eval.empty()) {
      std::cout << "\n  eval loss  " << absl::StrJoin(eval, " ") << " (" << j.spec().eval().batches()
                << " batches of " << j.spec().eval().dataset().path() << ")";
    }
  }
  if (!j.spec().resume_from().empty()) {
    std::cout << "\n  resumed from " << j.spec().resume_from() << " after step " << j.resumed_step();
  }
  if (j.checkpoint_step() > 0 && j.spec().mode() == MODE_TRAIN) {
    std::cout << (j.spec().resume_from().empty() ? "\n  " : "; ") << "checkpoint after step " << j.checkpoint_step();
    if (IsTerminal(j.state())) std::cout << " kept (fetch --checkpoint, submit --resume-from " << j.job_id() << ")";
  }
  std::cout << "\n  model " << HumanBytes(static_cast<double>(j.model_bytes()));
  if (!j.spec().data().file().empty()) std::cout << ", data " << j.spec().data().file();
  if (!j.spec().data().synthetic().empty()) std::cout << ", synthetic data " << j.spec().data().synthetic();
  if (const DatasetSpec& ds = j.spec().data().dataset(); !ds.path().empty()) {
    const DatasetSummary& d = j.dataset();
    std::cout << "\n  dataset " << (ds.uploaded() ? ds.uploaded_from() + " (uploaded)" : ds.path()) << ": "
              << d.shards() << (d.tokens() ? " token shards" : " tensor shards")
              << ", " << d.samples() << " samples";
    if (d.tokens()) std::cout << " of " << ds.seq_len() << " tokens";
    std::cout << ", shuffle " << (ds.shuffle() ? "on" : "off");
    if (d.steps_per_epoch() > 0) {
      const int64_t epochs = (j.spec().steps() + d.steps_per_epoch() - 1) / d.steps_per_epoch();
      std::cout << ", epoch " << std::min<int64_t>(epochs, j.step() / d.steps_per_epoch() + 1) << "/" << epochs << " ("
                << d.steps_per_epoch() << " steps each)";
    }
  }
  if (j.stage_file_bytes_size() > 0) {
    std::vector<std::string> sizes;
    for (int64_t b : j.stage_file_bytes()) sizes.push_back(HumanBytes(static_cast<double>(b)));
    std::cout << "; stage files " << absl::StrJoin(sizes, ", ");
  }
  std::cout << "\n";
  if (j.edges_size() > 0) {
    std::vector<std::string> edges;
    for (const StageEdge& e : j.edges()) {
      edges.push_back(absl::StrCat(e.from_stage(), "->", e.to_stage(), " ", e.transport(), " (rank ", e.from_rank(),
                                   "->", e.to_rank(), ")"));
    }
    std::cout << "  stage edges: " << absl::StrJoin(edges, ", ") << "\n";
  }
  if (j.spec().has_serving() && j.spec().serving().has_generation()) {
    const ServingSpec& sv = j.spec().serving();
    const GenerationSpec& gs = sv.generation();
    const GenerationStats& st = j.serving().generation();
    std::cout << absl::StrFormat("  generation: %d slots of %d positions, prefill chunks of %d tokens, up to %d "
                                 "sequences per micro-batch, %d micro-batches in the pipeline\n",
                                 gs.max_slots(), gs.max_seq(), gs.prefill_chunk(), sv.max_batch(),
                                 sv.max_inflight() > 0 ? sv.max_inflight() : j.plan().stages_size())
              << absl::StrFormat("  slots in use %d/%d, waiting %d; sequences %d (%d failed), tokens %d (prompt %d); "
                                 "%.1f tokens/s (last 10 s)\n",
                                 st.slots_in_use(), st.max_slots(), st.waiting(), st.sequences(), st.failed(),
                                 st.tokens(), st.prompt_tokens(), st.tokens_per_second())
              << absl::StrFormat("  micro-batches: %d prefill, %d decode (%.1f sequences each)\n",
                                 st.prefill_microbatches(), st.decode_microbatches(), st.mean_decode_rows());
    if (st.tokens() > 0) {
      std::cout << absl::StrFormat("  time to first token p50 %.1f ms, p99 %.1f ms; inter-token p50 %.1f ms, p99 %.1f "
                                   "ms\n",
                                   st.ttft_p50_ms(), st.ttft_p99_ms(), st.itl_p50_ms(), st.itl_p99_ms());
    }
  } else if (j.spec().has_serving()) {
    const ServingSpec& sv = j.spec().serving();
    const ServingStats& st = j.serving();
    std::cout << "  serving: micro-batches of up to " << sv.max_batch() << " rows or " << sv.max_delay_ms()
              << " ms, " << (sv.max_inflight() > 0 ? sv.max_inflight() : j.plan().stages_size() + 1)
              << " in the pipeline at most\n"
              << absl::StrFormat("  requests %d (%d failed), rows %d, micro-batches %d (%.1f rows each), queued %d, "
                                 "in flight %d\n",
                                 st.requests(), st.failed(), st.rows(), st.microbatches(), st.mean_batch_rows(),
                                 st.queued(), st.inflight());
    if (st.requests() > 0) {
      std::cout << absl::StrFormat("  latency p50 %.2f ms, p99 %.2f ms; %.1f requests/s (last %d requests)\n",
                                   st.p50_ms(), st.p99_ms(), st.requests_per_second(),
                                   std::min<int64_t>(st.requests(), 4096));
    }
  }
  if (j.spec().mode() == MODE_TRAIN) {
    const FaultToleranceSpec& ft = j.spec().fault_tolerance();
    std::cout << "  checkpoint: "
              << (j.checkpoint_step() > 0 ? absl::StrCat("after step ", j.checkpoint_step()) : std::string("none yet"))
              << " (every " << ft.checkpoint_every() << " steps); restarts " << j.restarts() << " of "
              << ft.max_restarts() << "\n";
  }
  for (const JobEvent& ev : j.history()) {
    std::cout << "  " << absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(ev.unix_ms()), absl::LocalTimeZone())
              << "  " << ev.message() << "\n";
  }
  const int replicas = std::max(1, j.spec().replicas());
  const int tp = std::max(1, j.spec().tensor_parallel().size());
  if (tp > 1) {
    std::cout << "  tensor parallel: " << tp << " ranks per stage (" << tp::PlanText(j.spec().tensor_parallel())
              << ")\n";
  }
  if ((replicas > 1 || tp > 1) && j.workers_size() > 0) {
    // The (replica, shard) x stage grid: which worker holds each stage of each copy; a
    // stage's tensor-parallel group is its column within one replica.
    const int copies = replicas * tp;
    const int per_copy = j.workers_size() / copies;
    for (int c = 0; c < copies; ++c) {
      std::vector<std::string> cells;
      for (int st = 0; st < j.stage_ranks_size(); ++st) {
        const int g = c * per_copy + j.stage_ranks(st);
        cells.push_back(absl::StrCat("stage ", st, ": ", g < j.workers_size() ? j.workers(g) : "?"));
      }
      std::cout << "  " << (replicas > 1 ? absl::StrCat("replica ", c / tp) : "")
                << (replicas > 1 && tp > 1 ? " " : "") << (tp > 1 ? absl::StrCat("shard ", c % tp) : "") << ": "
                << absl::StrJoin(cells, ", ") << "\n";
    }
  }
  for (const StepBreakdown& b : j.breakdown()) {
    std::string memory;
    if (b.peak_memory_bytes() > 0) {
      memory = absl::StrCat("; peak memory ", HumanBytes(static_cast<double>(b.peak_memory_bytes())));
      if (b.rank() < j.peak_memory_bytes_size()) {
        absl::StrAppend(&memory, " (job's most ", HumanBytes(static_cast<double>(j.peak_memory_bytes(b.rank()))), ")");
      }
    }
    std::cout << absl::StrFormat(
        "  rank %d%s, last step %.3f s: compute %.3f, waiting for peers %.3f, transport %.3f, optimizer %.3f, "
        "other %.3f%s%s\n",
        b.rank(),
        absl::StrCat(replicas > 1 ? absl::StrCat(" (replica ", b.replica(), ")") : "",
                     tp > 1 ? absl::StrCat(" (shard ", b.tp_rank(), ")") : ""),
        b.step_seconds(),
        b.compute_seconds(), b.wait_seconds(), b.transport_seconds(), b.optimizer_seconds(), b.other_seconds(),
        b.allreduce_seconds() > 0
            ? absl::StrFormat("; replica all-reduce %.3f, %.0f%% overlapped", b.allreduce_seconds(),
                              100 * std::clamp(1 - b.allreduce_wait_seconds() / b.allreduce_seconds(), 0.0, 1.0))
            : "",
        absl::StrCat(b.tp_allreduces() > 0 ? absl::StrFormat("; tensor-parallel all-reduce %.3f (%d, in compute)",
                                                              b.tp_allreduce_seconds(), b.tp_allreduces())
                                           : "",
                     memory));
  }
  if (j.losses_size() > 0) {
    // The last 10 (all of them: --output json), with the first and the lowest.
    constexpr int kShown = 10;
    const int n = j.losses_size();
    if (n > kShown) {
      int lowest = 0;
      for (int i = 1; i < n; ++i) {
        if (j.losses(i) < j.losses(lowest)) lowest = i;
      }
      std::cout << absl::StrFormat("  losses (%d steps): first %.4f, lowest %.4f at step %d, last %d:", n, j.losses(0),
                                   j.losses(lowest), lowest + 1, kShown);
    } else {
      std::cout << "  losses:";
    }
    for (int i = std::max(0, n - kShown); i < n; ++i) std::cout << " " << absl::StrFormat("%.4f", j.losses(i));
    std::cout << "\n";
  }
  if (j.reason().find('\n') != std::string::npos) {
    std::cout << "  reason, whole:\n";
    for (absl::string_view line : absl::StrSplit(j.reason(), '\n')) std::cout << "    " << line << "\n";
  }
}

// One GetJob, within 10 s.
absl::StatusOr<Job> GetJobOnce(Coordinator::Stub* stub, const std::string& id, const GlobalFlags& g) {
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  GetJobRequest req;
  req.set_job_id(id);
  Job job;
  grpc::Status s = stub->GetJob(&ctx, req, &job);
  if (!s.ok()) return FromGrpc(s, g.coordinator);
  return job;
}

// Follows a job until it ends; returns its final record. A coordinator that goes away
// (a restart) is dialled again for up to kWatchReconnect.
constexpr absl::Duration kWatchReconnect = absl::Seconds(120);

absl::StatusOr<Job> Watch(Coordinator::Stub* stub, const std::string& job_id, const GlobalFlags& g) {
  const bool json = g.output == "json";
  const bool tty = isatty(1) && !json;
  std::string last_message;
  absl::Time lost_since = absl::InfiniteFuture();
  while (true) {
    grpc::ClientContext ctx;
    Authorize(&ctx, g);
    WatchJobRequest req;
    req.set_job_id(job_id);
    auto reader = stub->WatchJob(&ctx, req);
    ProgressEvent e;
    bool ended = false;
    while (reader->Read(&e)) {
      lost_since = absl::InfiniteFuture();
      if (json) {
        std::cout << Json(e) << std::endl;
      } else {
        int width = 30, done = e.steps() > 0 ? width * e.step() / e.steps() : 0;
        std::string bar = std::string(done, '#') + std::string(width - done, '.');
        std::string line = absl::StrFormat("[%s] %s step %d/%d", bar, JobState_Name(e.state()), e.step(), e.steps());
        if (e.step() > 0) {
          absl::StrAppend(&line, absl::StrFormat("  loss %.4f  %.0f samples/s  bubble %.0f%%", e.loss(),
                                                 e.samples_per_second(), 100 * e.bubble_fraction()));
          if (e.lr() > 0) absl::StrAppend(&line, absl::StrFormat("  lr %.3g", e.lr()));
          if (e.has_eval_loss()) {
            absl::StrAppend(&line, absl::StrFormat("  eval loss %.4f (step %d)", e.eval_loss(), e.eval_step()));
          }
        }
        // Events (a worker lost, a restart) get a line of their own.
        if (!IsTerminal(e.state()) && !e.message().empty() && e.message() != last_message) {
          std::cout << (tty ? "\r" : "") << e.message() << (tty ? "\n" : "\n");
        }
        if (IsTerminal(e.state()) && !e.message().empty()) absl::StrAppend(&line, "  ", e.message());
        std::cout << (tty ? "\r" : "") << line << (tty ? "   " : "\n") << std::flush;
      }
      last_message = e.message();
      if (IsTerminal(e.state())) {
        ended = true;
        break;
      }
    }
    if (ended) ctx.TryCancel();
    grpc::Status s = reader->Finish();
    if (ended || s.ok()) break;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return FromGrpc(s, g.coordinator);
    const absl::Time now = absl::Now();
    if (lost_since == absl::InfiniteFuture()) {
      lost_since = now;
      std::cerr << kProgram << ": lost the coordinator at " << g.coordinator << " (" << s.error_message()
                << "); reconnecting for up to " << absl::FormatDuration(kWatchReconnect) << "\n";
    }
    if (now - lost_since > kWatchReconnect) return FromGrpc(s, g.coordinator);
    absl::SleepFor(absl::Milliseconds(500));
  }
  if (tty) std::cout << "\n";
  return GetJobOnce(stub, job_id, g);
}

// Exit code of a finished job: 0 only if it SUCCEEDED.
int JobExitCode(const Job& job) {
  if (job.state() == SUCCEEDED) return kExitOk;
  std::cerr << kProgram << ": job " << job.job_id() << " " << JobState_Name(job.state()) << ": " << job.reason() << "\n";
  return kExitInternal;
}

// ---- submit ---------------------------------------------------------------------

// Where to cut the model: submit's and serve's flags, and the SplitSpec they make.
struct SplitFlags {
  std::string stages;  // N, or auto (chosen among the workers: JobSpec.auto_plan)
  std::vector<std::string> split_at;
  std::string balance = "params";
  int tensor_parallel = 1;
  std::string tp_plan;
};

void AddSplitFlags(CLI::App* cmd, SplitFlags* f) {
  cmd->add_option("--stages", f->stages,
                  "split automatically into this many stages; auto: pippy chooses, up to the idle workers, from "
                  "measured costs (docs/autoplan.md)")
      ->check(cli::PositiveOrAuto());
  cmd->add_option("--split-at", f->split_at, "or cut before these modules (see pippyctl split --help)")
      ->delimiter(',');
  cli::AddNameOption<Balance>(cmd, "--balance", &f->balance, "balance", "what an automatic split equalises")
      ->capture_default_str();
  cmd->add_option("--tensor-parallel", f->tensor_parallel,
                  "tensor parallelism: every stage computed by T ranks (T x the workers), its Linears and Embeddings "
                  "sharded as --tp-plan says (all-reduces over gloo); checked against the unsplit stages on the "
                  "example batch before the job runs")
      ->check(cli::Positive())->capture_default_str();
  cmd->add_option("--tp-plan", f->tp_plan,
                  "PATTERN=STYLE,... with STYLE colwise | rowwise (nn.Linear) | vocab (nn.Embedding), patterns "
                  "matching module paths atom by atom: layers.*.attn.q=colwise,...,layers.*.attn.o=rowwise");
}

absl::Status SetSplit(const SplitFlags& f, JobSpec* spec) {
  if (f.stages == "auto") {
    spec->mutable_auto_plan()->set_stages(true);
  } else if (!f.stages.empty()) {
    spec->mutable_split()->set_stages(std::stoi(f.stages));
  }
  for (const std::string& p : f.split_at) spec->mutable_split()->add_split_at(p);
  auto balance = job::ParseBalance(f.balance);
  if (!balance.ok()) return balance.status();
  spec->mutable_split()->set_balance(*balance);
  if (f.tensor_parallel > 1 || !f.tp_plan.empty()) {
    absl::StatusOr<TensorParallelSpec> tp = tp::ParsePlan(f.tp_plan, f.tensor_parallel);
    if (!tp.ok()) return tp.status();
    *spec->mutable_tensor_parallel() = *tp;
  }
  return absl::OkStatus();
}

// --dtype, submit's and serve's.
void AddDtypeFlag(CLI::App* cmd, std::string* dtype) {
  cli::AddNameOption<Precision>(cmd, "--dtype", dtype, "dtype", "compute precision")->capture_default_str();
}

absl::Status SetPrecision(const std::string& dtype, JobSpec* spec) {
  auto precision = job::ParsePrecision(dtype);
  if (!precision.ok()) return precision.status();
  spec->set_precision(*precision);
  return absl::OkStatus();
}

struct SubmitFlags {
  std::string model, data, synthetic, name, dtype = "fp32";
  std::string dataset, token_dtype, shuffle = "off", resume_from, eval_dataset;
  bool dataset_upload = false;
  int eval_every = 0, eval_batches = 0;
  int seq_len = 0, epochs = 0;
  SplitFlags split;
  std::string schedule, loss, optimizer, lr_schedule;
  std::string microbatches;  // N, or auto
  int batch_size = 0, stages_per_worker = 0, warmup_steps = 0;
  bool explain = false;
  std::optional<int> steps;
  double lr = 0.01, momentum = 0, clip = 0, min_lr = 0;
  std::optional<double> weight_decay, beta1, beta2, eps;
  std::optional<int> checkpoint_every, max_restarts;
  std::optional<double> recovery_timeout_s;
  int replicas = 1;
  uint64_t seed = 0;
  bool wait = false;
  bool detach = false;
};

absl::StatusOr<JobSpec> SpecFrom(const SubmitFlags& f) {
  JobSpec spec;
  spec.set_name(f.name.empty() ? std::filesystem::path(f.model).stem().string() : f.name);
  absl::Status split = SetSplit(f.split, &spec);
  if (!split.ok()) return split;
  absl::Status precision = SetPrecision(f.dtype, &spec);
  if (!precision.ok()) return precision;
  absl::StatusOr<ScheduleKind> kind = SCHEDULE_KIND_UNSPECIFIED;
  if (f.schedule == "auto") {
    spec.mutable_auto_plan()->set_schedule(true);
  } else {
    kind = job::ParseSchedule(f.schedule);
    if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("schedule.kind: ", kind.status().message()));
  }
  spec.mutable_schedule()->set_kind(*kind);
  if (f.microbatches == "auto") {
    spec.mutable_auto_plan()->set_microbatches(true);
  } else {
    spec.mutable_schedule()->set_microbatches(std::stoi(f.microbatches));
  }
  spec.mutable_schedule()->set_stages_per_worker(f.stages_per_worker);
  if (*kind != SCHEDULE_INFERENCE) {
    if (!f.loss.empty()) {
      auto loss = job::ParseLoss(f.loss);
      if (!loss.ok()) return absl::InvalidArgumentError(absl::StrCat("loss: ", loss.status().message()));
      spec.set_loss(*loss);
    }
    if (!f.optimizer.empty()) {
      auto optimizer = job::ParseOptimizer(f.optimizer);
      if (!optimizer.ok()) return absl::InvalidArgumentError(absl::StrCat("optimizer.kind: ", optimizer.status().message()));
      spec.mutable_optimizer()->set_kind(*optimizer);
    }
    OptimizerSpec* o = spec.mutable_optimizer();
    o->set_lr(f.lr);
    o->set_momentum(f.momentum);
    if (f.weight_decay) o->set_weight_decay(*f.weight_decay);
    if (f.beta1) o->set_beta1(*f.beta1);
    if (f.beta2) o->set_beta2(*f.beta2);
    if (f.eps) o->set_eps(*f.eps);
    o->set_clip_grad_norm(f.clip);
    if (!f.lr_schedule.empty()) {
      auto kind = job::ParseLrSchedule(f.lr_schedule);
      if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("optimizer.lr_schedule: ", kind.status().message()));
      o->set_lr_schedule(*kind);
    }
    o->set_warmup_steps(f.warmup_steps);
    o->set_min_lr(f.min_lr);
  }
  spec.set_steps(f.steps.value_or(f.epochs > 0 ? 0 : 1));
  spec.set_epochs(f.epochs);
  spec.set_resume_from(f.resume_from);
  if (!f.eval_dataset.empty()) {
    EvalSpec* ev = spec.mutable_eval();
    ev->mutable_dataset()->set_path(std::filesystem::absolute(f.eval_dataset).lexically_normal().string());
    ev->set_every(f.eval_every);
    ev->set_batches(f.eval_batches);
  } else if (f.eval_every != 0 || f.eval_batches != 0) {
    return absl::InvalidArgumentError("--eval-every and --eval-batches are for --eval-dataset");
  }
  spec.set_batch_size(f.batch_size);
  if (!f.data.empty()) spec.mutable_data()->set_file(std::filesystem::path(f.data).filename().string());
  spec.mutable_data()->set_synthetic(f.synthetic);
  if (!f.dataset.empty()) {
    // Absolute, as the client sees it: the daemons read it where they run (a shared mount).
    DatasetSpec* ds = spec.mutable_data()->mutable_dataset();
    ds->set_path(std::filesystem::absolute(f.dataset).lexically_normal().string());
    ds->set_seq_len(f.seq_len);
    ds->set_shuffle(f.shuffle == "on");
    ds->set_uploaded(f.dataset_upload);
    if (f.dataset_upload) ds->set_uploaded_from(ds->path());
    if (!f.token_dtype.empty()) {
      auto dtype = job::ParseTokenDtype(f.token_dtype);
      if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("data.dataset.token_dtype: ", dtype.status().message()));
      ds->set_token_dtype(*dtype);
    }
  } else if (f.seq_len != 0 || !f.token_dtype.empty() || f.shuffle == "on") {
    return absl::InvalidArgumentError("--seq-len, --token-dtype and --shuffle are for --dataset");
  }
  spec.set_seed(f.seed);
  spec.set_replicas(f.replicas);
  FaultToleranceSpec* ft = spec.mutable_fault_tolerance();
  if (f.checkpoint_every) ft->set_checkpoint_every(*f.checkpoint_every);
  if (f.max_restarts) ft->set_max_restarts(*f.max_restarts);
  if (f.recovery_timeout_s) ft->set_recovery_timeout_s(*f.recovery_timeout_s);
  // The coordinator checks again; checking here saves uploading a large model for a
  // spec it would refuse.
  JobSpec checked = spec;
  absl::Status s = job::CheckSpec(&checked);
  if (!s.ok()) return s;
  return spec;
}

// Streams `path` into the submission, chunk by chunk.
absl::Status Stream(grpc::ClientWriter<SubmitJobRequest>* writer, const std::string& path, bool model) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "': no such file or not readable"));
  SubmitJobRequest req;
  // Read straight into the message: one copy less than reading into a buffer first.
  std::string* chunk = model ? req.mutable_model_chunk() : req.mutable_data_chunk();
  while (in) {
    chunk->resize(kChunk);
    in.read(chunk->data(), static_cast<std::streamsize>(chunk->size()));
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    chunk->resize(static_cast<size_t>(n));
    if (!writer->Write(req)) return absl::OkStatus();  // the coordinator refused; Finish says why
  }
  if (in.bad()) return absl::UnavailableError(absl::StrCat("reading '", path, "' failed"));
  return absl::OkStatus();
}

// Streams shard `path` of an uploaded dataset as DatasetFileChunks named `name`.
absl::Status StreamShard(grpc::ClientWriter<SubmitJobRequest>* writer, const std::string& path,
                         const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "': no such file or not readable"));
  SubmitJobRequest req;
  DatasetFileChunk* c = req.mutable_dataset_file();
  c->set_name(name);
  std::string* chunk = c->mutable_chunk();
  while (true) {
    chunk->resize(kChunk);
    in.read(chunk->data(), static_cast<std::streamsize>(chunk->size()));
    const std::streamsize n = std::max<std::streamsize>(0, in.gcount());
    chunk->resize(static_cast<size_t>(n));
    c->set_last_chunk(!in);  // a short read: the end (an empty file sends one empty last chunk)
    if (in.bad()) return absl::UnavailableError(absl::StrCat("reading '", path, "' failed"));
    if (!writer->Write(req)) return absl::OkStatus();  // the coordinator refused; Finish says why
    if (c->last_chunk()) return absl::OkStatus();
  }
}

// The shards of the dataset at `path` as the coordinator would list them (docs/data.md):
// a folder's *.bin and *.pt files in name order, or a manifest's lines. What they hold
// is checked by the coordinator once they are uploaded.
absl::StatusOr<std::vector<std::string>> ListShards(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> shards;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (fs::directory_iterator d(path, ec), end; !ec && d != end; d.increment(ec)) {
      const std::string name = d->path().filename().string();
      if (d->is_regular_file() && (absl::EndsWith(name, ".bin") || absl::EndsWith(name, ".pt"))) {
        shards.push_back(d->path().string());
      }
    }
    std::sort(shards.begin(), shards.end());
  } else {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat("data.dataset: cannot read '", path, "'"));
    const fs::path base = fs::path(path).parent_path();
    for (std::string line; std::getline(in, line);) {
      const std::string entry(absl::StripAsciiWhitespace(line));
      if (entry.empty() || entry[0] == '#') continue;
      shards.push_back(fs::path(entry).is_absolute() ? entry : (base / entry).string());
    }
  }
  if (shards.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("data.dataset: '", path, "' holds no shards (*.bin or *.pt)"));
  }
  return shards;
}

// An uploaded shard's name: its position (the shards sort by name in the dataset's
// order) and its file name with other characters than [A-Za-z0-9._-] as '_'.
std::string ShardName(size_t i, const std::string& path) {
  std::string base = std::filesystem::path(path).filename().string();
  for (char& ch : base) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_' && ch != '-') ch = '_';
  }
  return absl::StrFormat("%08d_%s", i, base.substr(0, 150));
}

// Submits the spec, the model and the data file (if any); returns the job's id.
// `detach`: the coordinator answers once the upload is stored (SubmitJobRequest.detach).
absl::StatusOr<std::string> Submit(Coordinator::Stub* stub, const JobSpec& spec, const std::string& model,
                                   const std::string& data, const GlobalFlags& g, bool detach = false,
                                   const std::vector<std::string>& shards = {}) {
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  SubmitJobResponse resp;
  auto writer = stub->SubmitJob(&ctx, &resp);
  SubmitJobRequest first;
  *first.mutable_spec() = spec;
  first.set_detach(detach);
  absl::Status streamed;
  if (writer->Write(first)) {
    streamed = Stream(writer.get(), model, /*model=*/true);
    if (streamed.ok() && !data.empty()) streamed = Stream(writer.get(), data, /*model=*/false);
    for (size_t i = 0; streamed.ok() && i < shards.size(); ++i) {
      streamed = StreamShard(writer.get(), shards[i], ShardName(i, shards[i]));
    }
  }
  if (!streamed.ok()) {
    ctx.TryCancel();
    writer->Finish();
    return streamed;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpc(s, g.coordinator);
  if (g.output == "json") {
    std::cout << Json(resp) << std::endl;
  } else {
    std::cout << resp.job_id() << std::endl;
    for (const std::string& n : resp.notices()) std::cerr << kProgram << ": note: " << n << "\n";
  }
  return resp.job_id();
}


// The job once the coordinator prepared it (a detached submission is PARTITIONING
// until then): within 10 minutes.
absl::StatusOr<Job> GetJobUntilPrepared(Coordinator::Stub* stub, const std::string& id, const GlobalFlags& g) {
  const absl::Time deadline = absl::Now() + absl::Minutes(10);
  while (true) {
    absl::StatusOr<Job> job = GetJobOnce(stub, id, g);
    if (!job.ok() || job->state() != PARTITIONING) return job;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("job ", id, " is still being prepared after 10 minutes"));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

int RunSubmit(const SubmitFlags& f, const GlobalFlags& g) {
  auto spec = SpecFrom(f);
  if (!spec.ok()) return Fail(kProgram, InCliWords(spec.status(), f.model, f.data));
  std::vector<std::string> shards;
  if (f.dataset_upload) {
    absl::StatusOr<std::vector<std::string>> listed = ListShards(f.dataset);
    if (!listed.ok()) return Fail(kProgram, InCliWords(listed.status(), f.model, f.data));
    shards = std::move(*listed);
  }
  auto stub = Connect(g);
  absl::StatusOr<std::string> id = Submit(stub.get(), *spec, f.model, f.data, g, f.detach, shards);
  if (!id.ok()) return Fail(kProgram, InCliWords(id.status(), f.model, f.data));
  const bool json = g.output == "json";
  if (f.explain && !json) {
    absl::StatusOr<Job> prepared = GetJobUntilPrepared(stub.get(), *id, g);
    if (!prepared.ok()) return Fail(kProgram, prepared.status());
    if (prepared->plan().has_choice()) {
      std::cerr << autoplan::RenderChoice(prepared->plan().choice());
    } else {
      std::cerr << kProgram << ": note: --explain: the plan was given, not chosen (no auto value)\n";
    }
  }
  if (!f.wait) return kExitOk;
  auto job = Watch(stub.get(), *id, g);
  if (!job.ok()) return Fail(kProgram, job.status());
  if (!json) PrintJob(*job);
  return JobExitCode(*job);
}

void AddSubmit(CLI::App& root, const GlobalFlags& g, int* exit_code) {
  auto f = std::make_shared<SubmitFlags>();
  CLI::App* cmd = root.add_subcommand(
      "submit", "Submit a training or inference job; prints its id (--wait follows it to the end). The "
                "coordinator splits the model once and sends each worker only its stages.");
  cmd->fallthrough();
  cmd->add_option("MODEL", f->model, "the TorchScript file (torch.jit.script(model).save(path))")
      ->required()
      ->check(CLI::ExistingFile);
  auto* data = cmd->add_option("--data", f->data,
                               "torch.save({\"inputs\": ..., \"targets\": ...}); step k trains on samples "
                               "[k*B, (k+1)*B) of it, wrapping around")
                   ->check(CLI::ExistingFile);
  auto* synthetic = cmd->add_option("--synthetic", f->synthetic,
                                    "data made by the coordinator instead, for benchmarks: "
                                    "\"inputs=float32[256,1024];targets=float32[256,1024];seed=0\" "
                                    "(int64[64,16]@64 for integers in [0, 64); without seed= the job's --seed)");
  data->excludes(synthetic);
  auto* dataset = cmd->add_option("--dataset", f->dataset,
                                  "a dataset the workers read themselves (docs/data.md): a folder of token streams "
                                  "(*.bin) or tensor shards (*.pt), or a manifest file listing them, at a path every "
                                  "worker and the coordinator can read (under their --dataset-root)");
  dataset->excludes(data)->excludes(synthetic);
  cmd->add_flag("--dataset-upload", f->dataset_upload,
                "send the --dataset's shards with the submission, for workers that share no file system: the "
                "coordinator keeps them for the job and streams each rank that reads them its copy, which it keeps "
                "on its disk (--scratch-dir) while it runs")
      ->needs(dataset);
  cmd->add_option("--seq-len", f->seq_len, "token streams: tokens per sample (each sample reads L + 1)")
      ->check(cli::Positive());
  cli::AddNameOption<TokenDtype>(cmd, "--token-dtype", &f->token_dtype, "token dtype",
                                 "token streams: the width of a token id (default uint16)");
  cmd->add_option("--shuffle", f->shuffle,
                  "on: each epoch reads the samples in a seeded order (--seed; docs/data.md); off: in order")
      ->check(CLI::IsMember({"on", "off"}))->capture_default_str();
  auto* epochs = cmd->add_option("--epochs", f->epochs,
                                 "passes over the dataset, instead of --steps (steps = epochs x samples / "
                                 "batch size, the last partial batch of each epoch dropped)")
                     ->check(cli::Positive());
  AddSplitFlags(cmd, &f->split);
  cli::AddNameOption<ScheduleKind>(cmd, "--schedule", &f->schedule, "schedule",
                                    "pipeline schedule; auto: pippy chooses from measured costs (docs/autoplan.md)",
                                    /*allow_auto=*/true)
      ->required();
  cmd->add_option("--stages-per-worker", f->stages_per_worker,
                  "stages each worker holds (interleaved schedules; default: the schedule's)")
      ->check(cli::Positive());
  cmd->add_option("--microbatches", f->microbatches,
                  "micro-batches per step; auto: pippy chooses from measured costs (docs/autoplan.md)")
      ->required()
      ->check(cli::PositiveOrAuto());
  cmd->add_flag("--explain", f->explain,
                "with auto: print every candidate plan, ranked (predicted samples/s, bubble, peak memory per "
                "rank) and why the chosen one won");
  cmd->add_option("--batch-size", f->batch_size, "samples per step (a multiple of --microbatches)")
      ->required()
      ->check(cli::Positive());
  cmd->add_option("--steps", f->steps, "optimizer steps (inference: batches; default 1)")
      ->check(cli::Positive())
      ->excludes(epochs);
  AddDtypeFlag(cmd, &f->dtype);
  cli::AddNameOption<LossKind>(cmd, "--loss", &f->loss, "loss", "the loss, on the last stage");
  cli::AddNameOption<OptimizerKind>(cmd, "--optimizer", &f->optimizer, "optimizer",
                                    "the optimizer, with torch.optim's semantics and defaults");
  cmd->add_option("--lr", f->lr, "learning rate")->check(cli::Positive())->capture_default_str();
  cmd->add_option("--momentum", f->momentum, "sgd momentum")->check(cli::NonNegative())->capture_default_str();
  cmd->add_option("--weight-decay", f->weight_decay, "default: torch's (0.01 for adamw, 0 for sgd and adam)")
      ->check(cli::NonNegative());
  cmd->add_option("--beta1", f->beta1, "adam/adamw (default 0.9)")->check(CLI::Range(0.0, 0.999999));
  cmd->add_option("--beta2", f->beta2, "adam/adamw (default 0.999)")->check(CLI::Range(0.0, 0.999999));
  cmd->add_option("--eps", f->eps, "adam/adamw (default 1e-8)")->check(cli::Positive());
  cmd->add_option("--clip-grad-norm", f->clip, "clip gradients to this global norm; 0: no clipping")
      ->check(cli::NonNegative())->capture_default_str();
  cli::AddNameOption<LrScheduleKind>(cmd, "--lr-schedule", &f->lr_schedule, "lr schedule",
                                     "how the learning rate changes over the steps, stepped after each optimizer "
                                     "step as torch.optim.lr_scheduler's (default constant)");
  cmd->add_option("--warmup-steps", f->warmup_steps,
                  "ramp the learning rate up linearly over the first W steps, (k + 1) / W x --lr at step k")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--min-lr", f->min_lr, "the learning rate linear and cosine decay to by the last step")
      ->check(cli::NonNegative())->capture_default_str();
  cmd->add_option("--name", f->name, "the job's name (default: the model file's name)");
  cmd->add_option("--seed", f->seed, "seeds each rank's random number generator (seed + rank) and synthetic data")->capture_default_str();
  cmd->add_option("--replicas", f->replicas,
                  "data parallelism: R copies of the pipeline (R x the workers), each training on a contiguous R-th "
                  "of every batch, gradients averaged (gloo) before the optimizer steps")
      ->check(cli::Positive())->capture_default_str();
  cmd->add_option("--eval-dataset", f->eval_dataset,
                  "evaluate on this validation dataset (as --dataset; its --seq-len and --token-dtype): the loss of "
                  "forward-only passes through the pipeline, beside the training loss");
  cmd->add_option("--eval-every", f->eval_every, "evaluate after every N-th step and after the last (default: "
                  "after the last only)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--eval-batches", f->eval_batches,
                  "batches of --batch-size each evaluation reads, the dataset's first ones in order (default: up to "
                  "100)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--resume-from", f->resume_from,
                  "start from job JOB's last checkpoint (its parameters, optimizer state, random generators and step): "
                  "the same model and split, with --steps counting the whole run; the learning-rate schedule and "
                  "the dataset's order go on from that step");
  cmd->add_option("--checkpoint-every", f->checkpoint_every,
                  "checkpoint the training state every N steps, so that a lost worker or coordinator costs at "
                  "most N steps (default 50; 0: none, a restart begins at step 0); the last one, and the state "
                  "after the last step, stay once the job ended (fetch --checkpoint, --resume-from)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-restarts", f->max_restarts,
                  "restarts from the last checkpoint after losing a worker before the job fails (default 3)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--recovery-timeout-s", f->recovery_timeout_s,
                  "how long a restart waits for enough idle workers before the job fails (default 300)")
      ->check(cli::Positive());
  cmd->add_flag("--wait", f->wait, "follow the job until it ends; exit 0 only if it SUCCEEDED");
  cmd->add_flag("--detach", f->detach,
                "return the job's id as soon as the upload is stored, without waiting for the coordinator to check "
                "and split the model: the job is PARTITIONING meanwhile, and a refusal shows as FAILED with its "
                "reason in `pippyctl status` (without --detach it is an error here, exit 2)");
  cmd->callback([f, &g, exit_code] { *exit_code = RunSubmit(*f, g); });
}

// ---- serve, infer -----------------------------------------------------------------

struct ServeFlags {
  std::string model, data, synthetic, name, dtype = "fp32";
  SplitFlags split;
  int max_batch = 0, max_inflight = 0, max_queued = 0;
  std::optional<int> max_delay_ms;
  uint64_t seed = 0;
  bool generate = false;
  int max_slots = 0, max_seq = 0, prefill_chunk = 0;
  bool wait = false;
  double wait_timeout_s = 600;
};

int RunServe(const ServeFlags& f, const GlobalFlags& g) {
  JobSpec spec;
  spec.set_name(f.name.empty() ? std::filesystem::path(f.model).stem().string() : f.name);
  absl::Status split = SetSplit(f.split, &spec);
  if (!split.ok()) return Fail(kProgram, split);
  absl::Status precision = SetPrecision(f.dtype, &spec);
  if (!precision.ok()) return Fail(kProgram, precision);
  ServingSpec* sv = spec.mutable_serving();
  sv->set_max_batch(f.max_batch);
  if (f.max_delay_ms) sv->set_max_delay_ms(*f.max_delay_ms);
  sv->set_max_inflight(f.max_inflight);
  sv->set_max_queued(f.max_queued);
  if (f.generate) {
    GenerationSpec* gen = sv->mutable_generation();
    gen->set_max_slots(f.max_slots);
    gen->set_max_seq(f.max_seq);
    gen->set_prefill_chunk(f.prefill_chunk);
  } else if (f.max_slots > 0 || f.max_seq > 0 || f.prefill_chunk > 0) {
    return Fail(kProgram, absl::InvalidArgumentError("--max-slots, --max-seq and --prefill-chunk are a generation "
                                                     "job's: add --generate"));
  }
  if (!f.data.empty()) spec.mutable_data()->set_file(std::filesystem::path(f.data).filename().string());
  spec.mutable_data()->set_synthetic(f.synthetic);
  spec.set_seed(f.seed);
  if (f.data.empty() && f.synthetic.empty()) {
    return Fail(kProgram, absl::InvalidArgumentError(
                              "serve needs an example input to split the model with: --example F (a request's input "
                              "or a data file) or --synthetic SPEC"));
  }
  JobSpec checked = spec;
  absl::Status ok = job::CheckSpec(&checked);
  if (!ok.ok()) return Fail(kProgram, InCliWords(ok, f.model, f.data));
  auto stub = Connect(g);
  absl::StatusOr<std::string> id = Submit(stub.get(), spec, f.model, f.data, g);
  if (!id.ok()) return Fail(kProgram, InCliWords(id.status(), f.model, f.data));
  if (!f.wait) return kExitOk;
  // Until its stages are loaded and it answers requests.
  const absl::Time deadline = absl::Now() + absl::Seconds(f.wait_timeout_s);
  while (true) {
    absl::StatusOr<Job> got = GetJobOnce(stub.get(), *id, g);
    if (!got.ok()) return Fail(kProgram, got.status());
    const Job& job = *got;
    if (job.state() == SERVING) return kExitOk;
    if (IsTerminal(job.state())) {
      return Fail(kProgram, absl::FailedPreconditionError(absl::StrCat("serving job ", *id, " ended ",
                                                                        JobState_Name(job.state()), ": ", job.reason())));
    }
    if (absl::Now() > deadline) {
      return Fail(kProgram, absl::DeadlineExceededError(absl::StrCat(
                                "serving job ", *id, " is still ", JobState_Name(job.state()), " after ",
                                f.wait_timeout_s, " s (--wait-timeout-s); pippyctl status ", *id, " says why")));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

void AddServe(CLI::App& root, const GlobalFlags& g, int* exit_code) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* cmd = root.add_subcommand(
      "serve", "Start a serving job: the model split into stages that stay loaded on their workers, answering "
               "Infer requests (pippyctl infer, the Python client, the gRPC API) until pippyctl cancel. Requests are "
               "grouped into micro-batches of up to --max-batch rows or --max-delay-ms, bucketed by shape (never "
               "padded), and pushed through the pipeline back to back. Prints the job's id.");
  cmd->fallthrough();
  cmd->add_option("MODEL", f->model, "the TorchScript file (torch.jit.script(model).save(path))")
      ->required()
      ->check(CLI::ExistingFile);
  auto* data = cmd->add_option("--example", f->data,
                               "an example input to split the model with: torch.save of forward()'s arguments (a "
                               "tensor, tuple or dict, as a request's input) or a data file")
                   ->check(CLI::ExistingFile);
  auto* synthetic = cmd->add_option("--synthetic", f->synthetic,
                                    "or an example made by the coordinator: \"inputs=float32[8,1024]\"");
  data->excludes(synthetic);
  AddSplitFlags(cmd, &f->split);
  AddDtypeFlag(cmd, &f->dtype);
  cmd->add_option("--max-batch", f->max_batch, "rows per micro-batch (default 32)")->check(cli::Positive());
  cmd->add_option("--max-delay-ms", f->max_delay_ms,
                  "how long the oldest waiting request may wait for others to share its micro-batch (default 5; "
                  "0: send at once)")
      ->check(CLI::Range(0, 60000));
  cmd->add_option("--max-inflight", f->max_inflight,
                  "micro-batches in the pipeline at most: one per stage as soon as due, more only full (default: stages "
                  "+ 1; 1: one at a time)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--max-queued", f->max_queued, "requests waiting at once; more are refused (RESOURCE_EXHAUSTED; "
                                                 "default 4096)")
      ->check(CLI::Range(1, 1000000));
  cmd->add_flag("--generate", f->generate,
                "a generation job: the model follows the generation contract (forward(idx, input_pos, slots) with KV "
                "caches as buffers [max_slots, heads, max_seq, head_dim]; docs/api.md#generation) and the job answers "
                "pippyctl generate / Generate with tokens streamed as they are sampled; --example is an (idx, "
                "input_pos, slots) tuple");
  cmd->add_option("--max-slots", f->max_slots,
                  "generation: sequences in the pipeline at once (default: the caches' dim 0)")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--max-seq", f->max_seq, "generation: positions per sequence (default: the caches' dim 2)")
      ->check(cli::Positive());
  cmd->add_option("--prefill-chunk", f->prefill_chunk,
                  "generation: prompt tokens per prefill micro-batch, between which decodes go on (default 64)")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--name", f->name, "the job's name, by which pippyctl infer finds it (default: the model file's)");
  cmd->add_option("--seed", f->seed, "seeds each rank's random number generator")->capture_default_str();
  cmd->add_flag("--wait", f->wait, "return once the job is SERVING (exit 1 if it failed first)");
  cmd->add_option("--wait-timeout-s", f->wait_timeout_s, "how long --wait waits")
      ->check(cli::Positive())->capture_default_str();
  cmd->callback([f, &g, exit_code] { *exit_code = RunServe(*f, g); });
}

int RunInfer(const std::string& job, const std::string& input, const std::string& out, double timeout_s,
             const GlobalFlags& g) {
  std::ifstream in(input, std::ios::binary);
  if (!in) return Fail(kProgram, absl::NotFoundError(absl::StrCat("cannot open '", input, "'")));
  InferRequest req;
  req.set_job(job);
  req.set_input(std::string(std::istreambuf_iterator<char>(in), {}));
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  InferResponse resp;
  const absl::Time start = absl::Now();
  grpc::Status s = stub->Infer(&ctx, req, &resp);
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  if (!out.empty()) {
    std::ofstream f(out, std::ios::binary | std::ios::trunc);
    f.write(resp.output().data(), static_cast<std::streamsize>(resp.output().size()));
    f.close();
    if (!f) return Fail(kProgram, absl::UnavailableError(absl::StrCat("cannot write '", out, "'")));
  }
  if (g.output == "json") {
    resp.clear_output();
    std::cout << Json(resp) << std::endl;
  } else {
    std::cout << absl::StrFormat("%d rows in %.2f ms (queued %.2f ms, pipeline %.2f ms, in a micro-batch of %d rows)%s\n",
                                 resp.rows(), ms, resp.queue_ms(), resp.pipeline_ms(), resp.microbatch_rows(),
                                 absl::StrCat(" -> ", out));
  }
  return kExitOk;
}

struct GenerateFlags {
  std::string job, prompt_file, tokens;
  int max_new_tokens = 16;
  float temperature = 0, top_p = 0;
  int top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<int64_t> stop_tokens;
  double timeout_s = 300;
};

// Prints the tokens as they come (space-separated, one line), then a summary on stderr.
int RunGenerate(const GenerateFlags& f, const GlobalFlags& g) {
  GenerateRequest req;
  req.set_job(f.job);
  if (!f.prompt_file.empty()) {
    std::ifstream in(f.prompt_file, std::ios::binary);
    if (!in) return Fail(kProgram, absl::NotFoundError(absl::StrCat("cannot open '", f.prompt_file, "'")));
    req.set_prompt(std::string(std::istreambuf_iterator<char>(in), {}));
  } else {
    for (absl::string_view t : absl::StrSplit(f.tokens, ',', absl::SkipWhitespace())) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(t, &v)) {
        return Fail(kProgram, absl::InvalidArgumentError(absl::StrCat("--tokens: '", t, "' is not a token id; give "
                                                                      "comma-separated integers (1,2,3)")));
      }
      req.add_tokens(v);
    }
    if (req.tokens_size() == 0) {
      return Fail(kProgram, absl::InvalidArgumentError("--tokens: empty; give comma-separated token ids"));
    }
  }
  req.set_max_new_tokens(f.max_new_tokens);
  req.set_temperature(f.temperature);
  req.set_top_k(f.top_k);
  req.set_top_p(f.top_p);
  if (f.seed) req.set_seed(*f.seed);
  for (int64_t t : f.stop_tokens) req.add_stop_tokens(t);
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000)));
  const absl::Time start = absl::Now();
  std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader = stub->Generate(&ctx, req);
  GenerateResponse resp, last;
  std::vector<int64_t> all;
  uint64_t seed = 0;
  bool first = true;
  while (reader->Read(&resp)) {
    if (first) seed = resp.seed();
    for (int64_t t : resp.tokens()) {
      if (g.output != "json") std::cout << (all.empty() ? "" : " ") << t << std::flush;
      all.push_back(t);
    }
    first = false;
    last = resp;
  }
  grpc::Status s = reader->Finish();
  if (g.output != "json" && !all.empty()) std::cout << std::endl;
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (g.output == "json") {
    GenerateResponse summary = last;
    summary.clear_tokens();
    for (int64_t t : all) summary.add_tokens(t);
    summary.set_seed(seed);
    std::cout << Json(summary) << std::endl;
  } else {
    std::cerr << absl::StrFormat("%d tokens in %.1f ms (first after %.1f ms; %s; seed %d)\n", all.size(), ms,
                                 last.ttft_ms(), last.finish_reason(), seed);
  }
  return kExitOk;
}

void AddGenerate(CLI::App& root, const GlobalFlags& g, int* exit_code) {
  auto f = std::make_shared<GenerateFlags>();
  CLI::App* cmd = root.add_subcommand(
      "generate", "Generate tokens from a prompt with a generation job (pippyctl serve --generate): prints the token "
                  "ids as they are sampled, then a summary on stderr. Greedy unless --temperature is given.");
  cmd->fallthrough();
  cmd->add_option("JOB", f->job, "the generation job's id or name")->required();
  auto* file = cmd->add_option("--prompt-file", f->prompt_file,
                               "the prompt: torch.save of a 1-D integer tensor or a list of token ids")
                   ->check(CLI::ExistingFile);
  auto* tokens = cmd->add_option("--tokens", f->tokens, "the prompt as comma-separated token ids (1,2,3)");
  file->excludes(tokens);
  cmd->add_option("--max-new-tokens", f->max_new_tokens, "tokens to generate at most")
      ->check(cli::Positive())->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0, 100.0))->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "sample among the k likeliest tokens (0: all)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", f->top_p, "sample among the likeliest tokens whose probabilities reach p (0: all)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", f->seed, "seeds the sampling: the same seed gives the same tokens (default: random)");
  cmd->add_option("--stop-token", f->stop_tokens, "a token id that ends the sequence (it is printed); repeatable");
  cmd->add_option("--timeout-s", f->timeout_s, "the request's deadline (its slot is freed when it passes)")
      ->check(cli::Positive())->capture_default_str();
  cmd->callback([f, &g, exit_code] {
    if (f->prompt_file.empty() && f->tokens.empty()) {
      *exit_code = Fail(kProgram, absl::InvalidArgumentError("give the prompt: --tokens 1,2,3 or --prompt-file F"));
      return;
    }
    *exit_code = RunGenerate(*f, g);
  });
}

// ---- list, workers, status, cancel, watch, fetch --------------------------------

struct ListArgs {
  int limit = 0;  // 0: every job
  std::vector<std::string> states;
  std::string user;
  bool newest_first = false;
};

int RunList(const ListArgs& a, const GlobalFlags& g) {
  ListJobsRequest req;
  for (const std::string& name : a.states) {
    JobState st;
    if (!JobState_Parse(absl::AsciiStrToUpper(name), &st) || st == JOB_STATE_UNSPECIFIED) {
      return Fail(kProgram, absl::InvalidArgumentError(absl::StrCat(
                                "--state: '", name, "' is not a job state (queued, placing, running, serving, "
                                "recovering, succeeded, failed, cancelled)")));
    }
    req.add_states(st);
  }
  req.set_user(a.user);
  if (a.newest_first) req.set_order_by("create_time desc");
  auto stub = Connect(g);
  ListJobsResponse all;
  // Page by page (the coordinator sends at most 1000 at a time) until --limit.
  do {
    grpc::ClientContext ctx;
    Authorize(&ctx, g);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const int want = a.limit > 0 ? a.limit - all.jobs_size() : 1000;
    req.set_page_size(std::min(want, 1000));
    ListJobsResponse page;
    grpc::Status s = stub->ListJobs(&ctx, req, &page);
    if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
    for (Job& j : *page.mutable_jobs()) *all.add_jobs() = std::move(j);
    req.set_page_token(page.next_page_token());
  } while (!req.page_token().empty() && (a.limit == 0 || all.jobs_size() < a.limit));
  if (g.output == "json") {
    std::cout << Json(all) << "\n";
    return kExitOk;
  }
  Table t({"job", "name", "user", "state", "schedule", "stages", "step", "loss", "reason"});
  for (const Job& j : all.jobs()) {
    t.AddRow({j.job_id(), j.spec().name(), j.user().empty() ? "-" : j.user(), JobState_Name(j.state()),
              job::ScheduleName(j.spec().schedule().kind()), absl::StrCat(j.num_stages()),
              absl::StrCat(j.step(), "/", j.spec().steps()),
              j.has_last_loss() ? absl::StrFormat("%.4f", j.last_loss()) : "-", FirstLine(j.reason(), 80)});
  }
  std::cout << t.Render();
  return kExitOk;
}

// A job named on the command line: its id (job-N) as it is, else the newest job whose
// name (--name, or the model file's) it is. Errors: NOT_FOUND; what ListJobs returns.
absl::StatusOr<std::string> ResolveJob(const std::string& id_or_name, const GlobalFlags& g) {
  if (absl::StartsWith(id_or_name, "job-") &&
      id_or_name.find_first_not_of("0123456789", 4) == std::string::npos && id_or_name.size() > 4) {
    return id_or_name;
  }
  auto stub = Connect(g);
  ListJobsRequest req;
  req.set_order_by("create_time desc");
  req.set_page_size(1000);
  do {
    grpc::ClientContext ctx;
    Authorize(&ctx, g);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    ListJobsResponse page;
    grpc::Status s = stub->ListJobs(&ctx, req, &page);
    if (!s.ok()) return FromGrpc(s, g.coordinator);
    for (const Job& j : page.jobs()) {
      if (j.spec().name() == id_or_name) return j.job_id();
    }
    req.set_page_token(page.next_page_token());
  } while (!req.page_token().empty());
  return absl::NotFoundError(absl::StrCat("no job '", id_or_name,
                                          "': neither a job's id nor its name (pippyctl list shows both)"));
}

// Runs `run` on the job named by `id_or_name` (resolved by ResolveJob).
template <typename Run>
int OnJob(const std::string& id_or_name, const GlobalFlags& g, Run run) {
  absl::StatusOr<std::string> id = ResolveJob(id_or_name, g);
  if (!id.ok()) return Fail(kProgram, id.status());
  return run(*id);
}

int RunDelete(const std::string& job_id, const GlobalFlags& g) {
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  DeleteJobRequest r;
  r.set_job_id(job_id);
  DeleteJobResponse resp;
  grpc::Status s = stub->DeleteJob(&ctx, r, &resp);
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  if (g.output == "json") {
    std::cout << "{\"job_id\": " << JsonString(job_id) << ", \"deleted\": true}\n";
  } else {
    std::cout << "deleted " << job_id << "\n";
  }
  return kExitOk;
}

int RunWorkers(const GlobalFlags& g) {
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  ListWorkersResponse r;
  grpc::Status s = stub->ListWorkers(&ctx, ListWorkersRequest(), &r);
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  if (g.output == "json") {
    std::cout << Json(r) << "\n";
    return kExitOk;
  }
  Table t({"worker", "name", "host", "device", "threads", "free memory", "state", "job", "rank", "stages",
           "received"});
  for (const WorkerInfo& w : r.workers()) {
    const bool busy = !w.job_id().empty();
    const std::string device = w.device_name().empty() ? w.device() : absl::StrCat(w.device(), " (", w.device_name(), ")");
    t.AddRow({w.worker_id(), w.name(), w.host(), device, absl::StrCat(w.threads()),
              HumanBytes(static_cast<double>(w.free_memory())),
              absl::AsciiStrToLower(WorkerState_Name(w.state())), busy ? w.job_id() : "-",
              busy ? (w.replica() > 0 ? absl::StrCat(w.rank(), " (replica ", w.replica(), ")") : absl::StrCat(w.rank()))
                   : "-",
              busy ? absl::StrJoin(w.stages(), ",") : "-",
              busy && w.bytes_received() > 0 ? HumanBytes(static_cast<double>(w.bytes_received())) : "-"});
  }
  std::cout << t.Render();
  return kExitOk;
}

int RunStatusOrCancel(const std::string& job_id, bool cancel, const GlobalFlags& g) {
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  Job j;
  grpc::Status s;
  if (cancel) {
    CancelJobRequest r;
    r.set_job_id(job_id);
    s = stub->CancelJob(&ctx, r, &j);
  } else {
    GetJobRequest r;
    r.set_job_id(job_id);
    s = stub->GetJob(&ctx, r, &j);
  }
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  if (g.output == "json") {
    std::cout << Json(j) << "\n";
  } else {
    PrintJob(j);
  }
  return kExitOk;
}

int RunWatch(const std::string& job_id, const GlobalFlags& g) {
  auto stub = Connect(g);
  auto j = Watch(stub.get(), job_id, g);
  if (!j.ok()) return Fail(kProgram, j.status());
  if (g.output != "json") PrintJob(*j);
  return JobExitCode(*j);
}

int RunFetch(const std::string& job_id, const std::string& out, bool checkpoint, const GlobalFlags& g) {
  auto stub = Connect(g, /*bulk_receive=*/true);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  FetchModelRequest r;
  r.set_job_id(job_id);
  r.set_checkpoint(checkpoint);
  auto reader = stub->FetchModel(&ctx, r);
  // Chunks go to a temporary file beside OUT, renamed into place once all arrived.
  const std::string tmp = out + ".part";
  std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
  if (!file) return Fail(kProgram, absl::PermissionDeniedError(absl::StrCat("cannot write '", tmp, "'")));
  int64_t bytes = 0;
  ModelChunk c;
  while (reader->Read(&c)) {
    file.write(c.data().data(), static_cast<std::streamsize>(c.data().size()));
    bytes += static_cast<int64_t>(c.data().size());
    if (!file) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  file.close();
  if (!file) {
    std::remove(tmp.c_str());
    return Fail(kProgram, absl::UnavailableError(absl::StrCat("writing '", tmp, "' failed (disk full?)")));
  }
  if (!s.ok()) {
    std::remove(tmp.c_str());
    return Fail(kProgram, FromGrpc(s, g.coordinator));
  }
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    return Fail(kProgram, absl::PermissionDeniedError(absl::StrCat("cannot move '", tmp, "' to '", out, "'")));
  }
  if (g.output == "json") {
    std::cout << "{\"job_id\": " << JsonString(job_id) << ", \"path\": " << JsonString(out) << ", \"bytes\": " << bytes
              << "}\n";
  } else {
    std::cout << "wrote " << (checkpoint ? "the last checkpoint of " : "the result of ") << job_id << " to " << out
              << " (" << HumanBytes(static_cast<double>(bytes)) << ")\n";
  }
  return kExitOk;
}

// A step's trace as a Chrome trace-event file (Perfetto, chrome://tracing): one process
// per rank (its worker), one track per stage and one for the rank's own work.
std::string ChromeTrace(const StepTrace& t) {
  int64_t origin = INT64_MAX;
  auto wall = [](const RankTrace& r, const TraceEvent& e) {
    return e.begin_us() - r.steady_anchor_us() + r.unix_anchor_us();
  };
  for (const RankTrace& r : t.ranks()) {
    for (const TraceEvent& e : r.events()) origin = std::min(origin, wall(r, e));
  }
  std::vector<std::string> events;
  auto quoted = [](const std::string& s) { return absl::StrCat("\"", absl::CEscape(s), "\""); };
  for (const RankTrace& r : t.ranks()) {
    if (r.rank() < 0) {
      // A generation job's micro-batches as the coordinator saw them: one lane per
      // micro-batch in flight, each from its dispatch to its sampled tokens' return.
      events.push_back(absl::StrFormat(
          R"({"name": "process_name", "ph": "M", "pid": 1000, "tid": 0, "args": {"name": %s}})",
          quoted("coordinator: generation micro-batches in the pipeline (dispatch to sampled tokens)")));
      for (int lane : r.stages()) {
        events.push_back(absl::StrFormat(
            R"({"name": "thread_name", "ph": "M", "pid": 1000, "tid": %d, "args": {"name": "in flight #%d"}})",
            lane + 1, lane + 1));
      }
      for (const TraceEvent& e : r.events()) {
        events.push_back(absl::StrFormat(
            R"({"name": %s, "cat": "%s", "ph": "X", "ts": %d, "dur": %d, "pid": 1000, "tid": %d})", quoted(e.name()),
            absl::StartsWith(e.name(), "prefill") ? "prefill" : "decode", wall(r, e) - origin,
            std::max<int64_t>(e.duration_us(), 1), e.stage() + 1));
      }
      continue;
    }
    events.push_back(absl::StrFormat(
        R"({"name": "process_name", "ph": "M", "pid": %d, "tid": 0, "args": {"name": %s}})", r.rank(),
        quoted(absl::StrCat("rank ", r.rank(), " (worker ", r.worker(), ")"))));
    events.push_back(absl::StrFormat(
        R"({"name": "thread_name", "ph": "M", "pid": %d, "tid": 0, "args": {"name": "step end"}})", r.rank()));
    for (int s : r.stages()) {
      events.push_back(absl::StrFormat(
          R"({"name": "thread_name", "ph": "M", "pid": %d, "tid": %d, "args": {"name": "stage %d"}})", r.rank(),
          s + 1, s));
    }
    int64_t end = 0;
    for (const TraceEvent& e : r.events()) end = std::max(end, wall(r, e) + e.duration_us() - origin);
    if (r.breakdown().peak_memory_bytes() > 0) {
      // The step's memory peak as a counter track of the rank (at the step's end).
      events.push_back(absl::StrFormat(
          R"({"name": "peak memory", "ph": "C", "ts": %d, "pid": %d, "args": {"MiB": %.1f}})", end, r.rank(),
          static_cast<double>(r.breakdown().peak_memory_bytes()) / (1 << 20)));
    }
    for (const TraceEvent& e : r.events()) {
      const char* cat = e.kind() == TRACE_SEND || e.kind() == TRACE_RECV ? "transport"
                        : e.kind() == TRACE_COMPUTE                        ? "compute"
                                                                           : "step";
      events.push_back(absl::StrFormat(
          R"({"name": %s, "cat": "%s", "ph": "X", "ts": %d, "dur": %d, "pid": %d, "tid": %d, )"
          R"("args": {"bytes": %d, "wait_us": %d}})",
          quoted(e.name()), cat, wall(r, e) - origin, std::max<int64_t>(e.duration_us(), 1), r.rank(),
          e.stage() + 1, e.bytes(), e.wait_us()));
    }
  }
  return absl::StrCat(R"({"displayTimeUnit": "ms", "otherData": {"job": )", quoted(t.job_id()),
                      R"(, "step": )", t.step(), "},\n \"traceEvents\": [\n  ",
                      absl::StrJoin(events, ",\n  "), "\n]}\n");
}

int RunTrace(const std::string& job_id, int step, const std::string& out, const GlobalFlags& g) {
  auto stub = Connect(g);
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  GetTraceRequest r;
  r.set_job_id(job_id);
  r.set_step(step);
  StepTrace t;
  grpc::Status s = stub->GetTrace(&ctx, r, &t);
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, g.coordinator));
  std::ofstream file(out, std::ios::binary | std::ios::trunc);
  file << ChromeTrace(t);
  file.close();
  if (!file) return Fail(kProgram, absl::PermissionDeniedError(absl::StrCat("cannot write '", out, "'")));
  size_t events = 0;
  for (const RankTrace& rank : t.ranks()) events += static_cast<size_t>(rank.events_size());
  if (g.output == "json") {
    std::cout << "{\"job_id\": " << JsonString(job_id) << ", \"step\": " << t.step() + 1 << ", \"path\": "
              << JsonString(out) << ", \"events\": " << events << "}\n";
  } else {
    // Steps count from 1 in status ("step 60/60"); the trace numbers them from 0.
    std::cout << "wrote step " << t.step() + 1 << " of " << job_id << " (" << t.ranks_size() << " ranks, " << events
              << " events) to " << out << "; open it in https://ui.perfetto.dev or chrome://tracing\n";
  }
  return kExitOk;
}

// grpc.health.v1.Health/Check against a daemon, like grpc_health_probe: exit 0 when
// SERVING, 1 when it answers anything else, 3 when it cannot be reached.
int RunHealth(const std::string& target, const std::string& service, double timeout_s, const GlobalFlags& g) {
  const std::string where = target.empty() ? g.coordinator : target;
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(where, Credentials(g)));
  grpc::ClientContext ctx;
  Authorize(&ctx, g);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return Fail(kProgram, absl::UnavailableError(absl::StrCat("cannot reach ", where, " within ", timeout_s, " s (",
                                                              s.error_message(), ")")));
  }
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    return Fail(kProgram, absl::UnimplementedError(absl::StrCat(where, " serves no grpc.health.v1.Health (a worker "
                                                                "needs --health-port)")));
  }
  if (!s.ok()) return Fail(kProgram, FromGrpc(s, where));
  const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  // An insecure coordinator (--insecure) says so on every call.
  std::string warning;
  const auto& md = ctx.GetServerInitialMetadata();
  if (auto it = md.find("pippy-warning"); it != md.end()) warning.assign(it->second.data(), it->second.size());
  if (g.output == "json") {
    std::cout << "{\"target\": " << JsonString(where) << ", \"status\": " << JsonString(status)
              << (warning.empty() ? "" : ", \"warning\": " + JsonString(warning)) << "}\n";
  } else {
    std::cout << where << ": " << status << "\n";
    if (!warning.empty()) std::cout << "warning: " << warning << "\n";
  }
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitInternal;
}

}  // namespace

void AddRemoteCommands(CLI::App& root, const GlobalFlags& globals, int* exit_code) {
  AddSubmit(root, globals, exit_code);
  AddServe(root, globals, exit_code);
  AddGenerate(root, globals, exit_code);
  const GlobalFlags* g = &globals;
  auto infer = std::make_shared<std::tuple<std::string, std::string, std::string, double>>("", "", "", 60.0);
  CLI::App* infer_cmd = root.add_subcommand(
      "infer", "One request to a serving job: its output (the request's own rows of forward()'s result, a torch.save "
               "file) goes to -o");
  infer_cmd->fallthrough();
  infer_cmd->add_option("JOB", std::get<0>(*infer), "the serving job's id or name")->required();
  infer_cmd->add_option("--input", std::get<1>(*infer),
                        "torch.save of forward()'s arguments (a tensor, tuple or dict), rows along dim 0")
      ->required()
      ->check(CLI::ExistingFile);
  infer_cmd->add_option("-o,--out", std::get<2>(*infer), "where to write the output (torch.load reads it)")
      ->required();
  infer_cmd->add_option("--timeout-s", std::get<3>(*infer), "the request's deadline")
      ->check(cli::Positive())->capture_default_str();
  infer_cmd->callback([g, infer, exit_code] {
    *exit_code = RunInfer(std::get<0>(*infer), std::get<1>(*infer), std::get<2>(*infer), std::get<3>(*infer), *g);
  });
  auto list_args = std::make_shared<ListArgs>();
  CLI::App* list = root.add_subcommand("list", "Jobs and their states, oldest first (summaries: pippyctl status JOB has the rest)");
  list->fallthrough();
  list->add_option("--limit", list_args->limit, "at most this many jobs (0: all)")
      ->check(cli::NonNegative())->capture_default_str();
  list->add_option("--state", list_args->states, "only jobs in this state (repeat for several): queued, running, ...");
  list->add_option("--user", list_args->user, "only jobs this user submitted");
  list->add_flag("--newest-first", list_args->newest_first, "the newest jobs first (with --limit: the last N)");
  list->callback([g, list_args, exit_code] { *exit_code = RunList(*list_args, *g); });
  auto health = std::make_shared<std::tuple<std::string, std::string, double>>("", "", 5.0);
  CLI::App* health_cmd = root.add_subcommand(
      "health", "grpc.health.v1 check of a daemon (the coordinator, or a worker's --health-port): exit 0 when SERVING");
  health_cmd->fallthrough();
  health_cmd->add_option("TARGET", std::get<0>(*health), "HOST:PORT (default: --coordinator)");
  health_cmd->add_option("--service", std::get<1>(*health), "the service to ask about (default: the whole server)");
  health_cmd->add_option("--timeout-s", std::get<2>(*health), "deadline of the check")
      ->check(cli::Positive())->capture_default_str();
  health_cmd->callback([g, health, exit_code] {
    *exit_code = RunHealth(std::get<0>(*health), std::get<1>(*health), std::get<2>(*health), *g);
  });
  CLI::App* workers = root.add_subcommand("workers", "Registered workers: state, job, rank, stages, bytes received");
  workers->fallthrough();
  workers->callback([g, exit_code] { *exit_code = RunWorkers(*g); });

  auto job_id = std::make_shared<std::string>();
  auto with_job = [&root, job_id](const std::string& name, const std::string& what) {
    CLI::App* cmd = root.add_subcommand(name, what);
    cmd->fallthrough();
    cmd->add_option("JOB", *job_id, "the job's id or name (the newest job of that name; pippyctl list shows both)")
        ->required();
    return cmd;
  };
  with_job("status", "One job: state, reason, step, losses, throughput, sizes")->callback([g, job_id, exit_code] {
    *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunStatusOrCancel(id, /*cancel=*/false, *g); });
  });
  with_job("cancel",
           "Stop a job: it ends CANCELLED at once; its workers stop their step in progress and are free again")
      ->callback([g, job_id, exit_code] {
        *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunStatusOrCancel(id, /*cancel=*/true, *g); });
      });
  with_job("delete",
           "Delete an ended job: its record, its files and its trained model (cancel a running job first)")
      ->callback([g, job_id, exit_code] {
        *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunDelete(id, *g); });
      });
  with_job("watch", "A live progress bar until the job ends (exit 0 only if it SUCCEEDED)")
      ->callback([g, job_id, exit_code] {
        *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunWatch(id, *g); });
      });
  auto out = std::make_shared<std::string>();
  CLI::App* fetch = with_job("fetch",
                             "Download a finished job's result: the trained model (ONE TorchScript file like the "
                             "submitted one) or an inference job's outputs (a torch.save file)");
  fetch->add_option("-o,--out", *out, "where to write it")->required();
  auto checkpoint = std::make_shared<bool>(false);
  fetch->add_flag("--checkpoint", *checkpoint,
                  "the job's last checkpoint instead, as one TorchScript model: of a running, cancelled, failed or "
                  "succeeded training job");
  fetch->callback([g, job_id, out, checkpoint, exit_code] {
    *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunFetch(id, *out, *checkpoint, *g); });
  });
  auto trace_out = std::make_shared<std::string>();
  auto trace_step = std::make_shared<int>(-1);
  CLI::App* trace = with_job("trace",
                             "Write a step of a job as a Chrome trace-event file (Perfetto, chrome://tracing): one "
                             "process per rank, one track per stage, every action timed with its bytes and waits");
  trace->add_option("-o,--out", *trace_out, "where to write it (JSON)")->required();
  trace->add_option("--step", *trace_step, "the step (default: the last; the coordinator keeps the last 4)")
      ->check(CLI::Range(-1, 1 << 30));
  trace->callback([g, job_id, trace_out, trace_step, exit_code] {
    *exit_code = OnJob(*job_id, *g, [&](const std::string& id) { return RunTrace(id, *trace_step, *trace_out, *g); });
  });
}

}  // namespace pippy::cli
