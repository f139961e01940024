#include "pipeline/stage/step_collectives.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"

namespace pippy::stage {
namespace {

using transport::Tag;

Tag MakeTag(Tag::Kind kind, int step, int phase, int src, int dst, int index) {
  Tag t;
  t.kind = kind;
  t.step = static_cast<uint32_t>(step);
  t.microbatch = static_cast<uint32_t>(phase);  // 0: towards the gatherer, 1: back
  t.src_stage = static_cast<uint32_t>(src);
  t.dst_stage = static_cast<uint32_t>(dst);
  t.index = static_cast<uint32_t>(index);
  return t;
}

absl::Status Malformed(int peer, const std::string& what, const std::string& why) {
  return absl::DataLossError(absl::StrCat("rank ", peer, " sent a malformed ", what, ": ", why));
}

// A received number (the transport carries Python floats as doubles).
absl::StatusOr<double> AsNumber(const c10::IValue& v, int peer, const std::string& what) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  return Malformed(peer, what, absl::StrCat("expected a number, got ", v.tagKind()));
}

// A received tensor of `shape`, or None.
absl::StatusOr<at::Tensor> AsGradient(const c10::IValue& v, const std::vector<int64_t>& shape, int peer,
                                      const std::string& what) {
  if (v.isNone()) return at::Tensor();
  if (!v.isTensor()) return Malformed(peer, what, absl::StrCat("expected a tensor or None, got ", v.tagKind()));
  const at::Tensor& t = v.toTensor();
  if (t.sizes().vec() != shape) {
    return Malformed(peer, what, absl::StrCat("shape ", c10::str(t.sizes()), " where ", c10::str(shape),
                                              " was expected"));
  }
  if (!at::isFloatingType(t.scalar_type())) return Malformed(peer, what, "not a floating-point tensor");
  return t;
}

}  // namespace

absl::StatusOr<double> AllReduceSum(const CollectiveContext& ctx, double local, const std::string& what) {
  const std::string where = absl::StrCat("rank ", ctx.rank, " step ", ctx.step, " ", what);
  if (ctx.rank == 0) {
    double total = local;
    for (int r = 1; r < ctx.num_ranks; ++r) {
      auto w = ctx.transport->Recv(r, MakeTag(Tag::Kind::kGradNorm, ctx.step, 0, 0, 0, r));
      PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
      PIPPY_ASSIGN_OR_RETURN(double v, AsNumber(w->Value(), r, what));
      total += v;
    }
    std::vector<std::shared_ptr<transport::Work>> sends;
    for (int r = 1; r < ctx.num_ranks; ++r) {
      sends.push_back(ctx.transport->Send(r, MakeTag(Tag::Kind::kGradNorm, ctx.step, 1, 0, 0, r), total));
    }
    for (auto& w : sends) PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
    return total;
  }
  auto sent = ctx.transport->Send(0, MakeTag(Tag::Kind::kGradNorm, ctx.step, 0, 0, 0, ctx.rank), local);
  auto w = ctx.transport->Recv(0, MakeTag(Tag::Kind::kGradNorm, ctx.step, 1, 0, 0, ctx.rank));
  PIPPY_RETURN_IF_ERROR(ctx.wait(sent, where));
  PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
  return AsNumber(w->Value(), 0, what);
}

absl::StatusOr<at::Tensor> SumTiedGradient(const CollectiveContext& ctx, const TiedGroup& g,
                                           const std::vector<std::vector<at::Tensor>>& local, int m) {
  const std::string what = absl::StrCat("tied-gradient contribution of '", g.name, "'");
  const std::string where = absl::StrCat("rank ", ctx.rank, " step ", ctx.step, " tied-gradient sync of '", g.name, "'");
  // The rank of the first holder stage gathers.
  int gatherer = -1;
  for (const auto& [r, stages] : g.stages_of_rank) {
    for (int s : stages) {
      if (s == g.holders.front()) gatherer = r;
    }
  }
  const std::vector<int>& mine = g.stages_of_rank.at(ctx.rank);
  if (ctx.rank != gatherer) {
    // Send this rank's contributions as a tuple (per holder stage) of tuples (per mb).
    std::vector<c10::IValue> per_stage;
    for (const auto& contributions : local) {
      std::vector<c10::IValue> per_mb;
      for (const at::Tensor& t : contributions) per_mb.push_back(t.defined() ? c10::IValue(t) : c10::IValue());
      per_stage.push_back(c10::ivalue::Tuple::create(std::move(per_mb)));
    }
    auto sent = ctx.transport->Send(gatherer, MakeTag(Tag::Kind::kTiedGradient, ctx.step, 0, mine[0], g.holders[0],
                                                      g.group),
                                    c10::ivalue::Tuple::create(std::move(per_stage)));
    auto w = ctx.transport->Recv(gatherer, MakeTag(Tag::Kind::kTiedGradient, ctx.step, 1, g.holders[0], mine[0],
                                                   g.group));
    PIPPY_RETURN_IF_ERROR(ctx.wait(sent, where));
    PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
    return AsGradient(w->Value(), g.shape, gatherer, absl::StrCat("summed tied gradient of '", g.name, "'"));
  }
  // The gatherer: contributions by stage, then the sum in the unsplit model's order.
  std::map<int, std::vector<at::Tensor>> by_stage;
  for (size_t i = 0; i < mine.size(); ++i) by_stage[mine[i]] = local[i];
  for (const auto& [r, stages] : g.stages_of_rank) {
    if (r == ctx.rank) continue;
    auto w = ctx.transport->Recv(r, MakeTag(Tag::Kind::kTiedGradient, ctx.step, 0, stages[0], g.holders[0], g.group));
    PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
    const c10::IValue v = w->Value();
    if (!v.isTuple() || v.toTupleRef().elements().size() != stages.size()) {
      return Malformed(r, what, absl::StrCat("expected a tuple of ", stages.size(), " stage(s)"));
    }
    const auto& per_stage = v.toTupleRef().elements();
    for (size_t i = 0; i < stages.size(); ++i) {
      if (!per_stage[i].isTuple() || per_stage[i].toTupleRef().elements().size() != static_cast<size_t>(m)) {
        return Malformed(r, what, absl::StrCat("expected ", m, " micro-batch contributions for stage ", stages[i]));
      }
      std::vector<at::Tensor>& out = by_stage[stages[i]];
      for (const c10::IValue& c : per_stage[i].toTupleRef().elements()) {
        PIPPY_ASSIGN_OR_RETURN(at::Tensor t, AsGradient(c, g.shape, r, what));
        out.push_back(t);
      }
    }
  }
  at::Tensor total;
  PIPPY_RETURN_IF_ERROR(TorchCall(where, [&] {
    for (int mb = 0; mb < m; ++mb) {
      at::Tensor sum;
      for (auto it = g.holders.rbegin(); it != g.holders.rend(); ++it) {
        const at::Tensor& c = by_stage[*it].at(static_cast<size_t>(mb));
        if (!c.defined()) continue;
        sum = sum.defined() ? sum + c : c;
      }
      if (sum.defined()) total = total.defined() ? total + sum : sum;
    }
  }, absl::StatusCode::kInternal));
  std::vector<std::shared_ptr<transport::Work>> sends;
  for (const auto& [r, stages] : g.stages_of_rank) {
    if (r == ctx.rank) continue;
    sends.push_back(ctx.transport->Send(r, MakeTag(Tag::Kind::kTiedGradient, ctx.step, 1, g.holders[0], stages[0],
                                                   g.group),
                                        total.defined() ? c10::IValue(total) : c10::IValue()));
  }
  for (auto& w : sends) PIPPY_RETURN_IF_ERROR(ctx.wait(w, where));
  return total;
}

}  // namespace pippy::stage
