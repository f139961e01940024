#!/usr/bin/python3
"""Compares a model trained by pippy with a plain PyTorch training loop.

usage: check_training.py MODEL.pt DATA.pt TRAINED.pt --steps N --batch-size B
                         --microbatches M --loss mse|cross_entropy|model
                         --optimizer sgd|adam|adamw --lr X [--momentum X] [--weight-decay X]
                         [--tolerance 1e-4] [--dtype fp32|bf16] [--device cpu|cuda]
                         [--losses JOB.json --loss-tolerance 0.01]
                         [--lr-schedule constant|linear|cosine --warmup-steps W --min-lr X]
       check_training.py MODEL.pt - TRAINED.pt --dataset DIR --seq-len L [--token-dtype uint16]
                         [--shuffle on|off --seed S]
                         [--eval-dataset DIR --eval-every N --eval-batches K --losses JOB.json] ...

The reference: torch.jit.load(MODEL) trained with torch.optim for N steps; step k uses
samples [k*B, (k+1)*B) of DATA (wrapping), with gradients accumulated over M equal
micro-batches (loss / M each), which is the computation a pipeline performs.
--dtype bf16: each micro-batch's forward under torch.autocast(device, torch.bfloat16),
the loss in fp32 on the output cast to fp32 (pippy's mixed precision). --device cuda:
the reference trains on the GPU (TF32 off, as pippy's fp32 jobs).
--lr-schedule: torch's schedulers, stepped after each optimizer step (cosine, W > 0:
SequentialLR([LambdaLR(lambda s: (s + 1) / W), CosineAnnealingLR(T_max=N - W,
eta_min=min_lr)], milestones=[W]); linear: LinearLR(start_factor=1, end_factor=min_lr /
lr, total_iters=N - W) in its place; constant, W > 0: LambdaLR(lambda s: min(1, (s + 1) / W))).
--dataset: the batches of a token dataset (docs/data.md), read here with numpy from the
shards (*.bin in name order, one stream): sample i the window of L + 1 tokens at i x L,
epochs of (T - 1) // L samples with the last partial batch dropped, each epoch in order
or, with --shuffle on, in the order of the documented permutation (written here in
Python from docs/data.md, not taken from pippy).
--eval-dataset: after every N-th step and the last, the model in eval mode without
gradients on the validation dataset's first K batches (in order), each batch's loss the
mean of its micro-batches' (as the training loss); the job's evals must match.
--losses: `pippyctl status JOB --output json`; its per-step losses must be within
--loss-tolerance (relative) of the reference's.
Prints the max relative difference over all parameters; exit 1 if above tolerance.
"""
import argparse
import contextlib
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F


def rows(step, batch, n):
    return torch.arange(step * batch, (step + 1) * batch) % n


M64 = (1 << 64) - 1


def mix(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def permuted(i, n, seed, epoch):
    """docs/data.md's permutation of epoch `epoch`: a 4-round Feistel network, cycle-walked."""
    h = max(1, ((n - 1).bit_length() + 1) // 2)
    m = (1 << h) - 1
    key = mix(seed ^ mix(epoch))
    x = i
    while True:
        left, right = x >> h, x & m
        for k in range(4):
            left, right = right, left ^ (mix(((key + k) & M64) ^ right) & m)
        x = (left << h) | right
        if x < n:
            return x


class TokenBatches:
    """A token dataset's batches as docs/data.md defines them."""

    def __init__(self, folder, seq_len, dtype, shuffle, seed, batch):
        import glob
        import numpy as np
        self.np = np
        self.shards = [np.memmap(f, dtype=dtype, mode="r") for f in sorted(glob.glob(os.path.join(folder, "*.bin")))]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.L, self.shuffle, self.seed, self.batch = seq_len, shuffle, seed, batch
        self.samples = (int(self.starts[-1]) - 1) // seq_len
        self.per_epoch = self.samples // batch

    def window(self, first, n):
        """Tokens [first, first + n) of the stream, across shards."""
        parts = []
        while n > 0:
            s = int(self.np.searchsorted(self.starts, first, side="right")) - 1
            at = first - int(self.starts[s])
            part = self.shards[s][at:at + n]
            parts.append(part.astype("int64"))
            first, n = first + len(part), n - len(part)
        return self.np.concatenate(parts)

    def __call__(self, step):
        epoch, first = step // self.per_epoch, (step % self.per_epoch) * self.batch
        idx = [first + j for j in range(self.batch)]
        if self.shuffle:
            idx = [permuted(i, self.samples, self.seed, epoch) for i in idx]
        windows = torch.stack([torch.from_numpy(self.window(i * self.L, self.L + 1)) for i in idx])
        return [windows[:, :-1].contiguous()], windows[:, 1:].contiguous()


def take(v, idx):
    return v.index_select(0, idx) if isinstance(v, torch.Tensor) else v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("trained")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--loss", required=True)
    ap.add_argument("--optimizer", required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--weight-decay", type=float, default=None,
                    help="default: torch.optim's (0.01 for AdamW, 0 otherwise), as pippy's")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--losses", help="pippyctl status JOB --output json")
    ap.add_argument("--loss-tolerance", type=float, default=0.01)
    ap.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--dataset", help="a token dataset folder (DATA is then '-')")
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--token-dtype", choices=["uint16", "uint32"], default="uint16")
    ap.add_argument("--shuffle", choices=["on", "off"], default="off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-dataset", help="a validation token dataset (needs --losses: the job's evals)")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=0)
    ap.add_argument("--eval-tolerance", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.dtype == "bf16":
        # As pippy runs TorchScript (graph optimisation off): the optimising executor's
        # autocast pass casts a few ops differently from eager autocast (losses then
        # differ by ~4e-4 relative on the zoo's GPT); with it off, autocast acts op by op.
        torch._C._set_graph_executor_optimize(False)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = torch.jit.load(a.model, map_location=device)
    if a.dataset:
        get_batch = TokenBatches(a.dataset, a.seq_len, a.token_dtype, a.shuffle == "on", a.seed, a.batch_size)
    else:
        data = torch.load(a.data, map_location=device)
        inputs, targets = data["inputs"], data["targets"]
        names = [arg.name for arg in model.forward.schema.arguments[1:]]
        if isinstance(inputs, dict):
            inputs = [inputs[n] for n in names]
        elif not isinstance(inputs, (tuple, list)) or len(names) == 1:
            inputs = [inputs]
        n = next(t.shape[0] for t in inputs if isinstance(t, torch.Tensor))

        def get_batch(step):
            idx = rows(step, a.batch_size, n)
            return [take(t, idx) for t in inputs], take(targets, idx)
    params = list(model.parameters())  # tied weights appear once
    wd = {} if a.weight_decay is None else {"weight_decay": a.weight_decay}
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=a.lr, momentum=a.momentum, **wd)
    elif a.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=a.lr, **wd)
    else:
        opt = torch.optim.AdamW(params, lr=a.lr, **wd)
    sched = None
    W, T = a.warmup_steps, a.steps - a.warmup_steps
    lrs = torch.optim.lr_scheduler
    # SequentialLR restarts its second scheduler with step(0), which torch 1.13 warns of.
    warnings.filterwarnings("ignore", message="The epoch parameter")
    if a.lr_schedule == "constant":
        if W > 0:
            sched = lrs.LambdaLR(opt, lambda s: min(1.0, (s + 1) / W))
    else:
        if a.lr_schedule == "cosine":
            decay = lrs.CosineAnnealingLR(opt, T_max=T, eta_min=a.min_lr)
        else:
            decay = lrs.LinearLR(opt, start_factor=1.0, end_factor=a.min_lr / a.lr, total_iters=T)
        sched = lrs.SequentialLR(opt, [lrs.LambdaLR(opt, lambda s: (s + 1) / W), decay], milestones=[W]) if W else decay
    used_lrs = []

    def loss_fn(out, tgt):
        if a.loss == "mse":
            return F.mse_loss(out, tgt)
        if a.loss == "cross_entropy":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))
        return model.loss(out, tgt)

    def autocast():
        if a.dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def as_fp32(out):
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float32:
            return out.float()
        if isinstance(out, tuple):
            return tuple(as_fp32(o) for o in out)
        return out

    m = a.microbatches
    losses = []
    evals = []  # (steps done, loss): model.eval(), no_grad, the mean of the micro-batches' losses
    val = TokenBatches(a.eval_dataset, a.seq_len, a.token_dtype, False, 0, a.batch_size) if a.eval_dataset else None

    def evaluate(done):
        model.eval()
        total = 0.0
        with torch.no_grad():
            for b in range(a.eval_batches):
                vb, vt = val(b)
                vchunks, vtchunks = vb[0].chunk(m, 0), vt.chunk(m, 0)
                total += sum(loss_fn(as_fp32(model(vchunks[k])), vtchunks[k]).item() for k in range(m)) / m
        model.train()
        evals.append((done, total / a.eval_batches))

    for step in range(a.steps):
        batch, tgt = get_batch(step)
        batch = [t.to(device) if isinstance(t, torch.Tensor) else t for t in batch]
        tgt = tgt.to(device)
        chunks = [t.chunk(m, 0) if isinstance(t, torch.Tensor) else [t] * m for t in batch]
        tchunks = tgt.chunk(m, 0)
        total = 0.0
        for k in range(m):
            with autocast():
                out = model(*[c[k] for c in chunks])
            loss = loss_fn(as_fp32(out) if a.dtype == "bf16" else out, tchunks[k])
            total += loss.item()
            (loss / m).backward()
        losses.append(total / m)
        used_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        if val is not None and (step + 1 == a.steps or (a.eval_every > 0 and (step + 1) % a.eval_every == 0)):
            evaluate(step + 1)

    status = 0
    if a.losses:
        with open(a.losses) as f:
            reported = json.load(f)
        got_losses = reported.get("losses", [])
        if len(got_losses) != len(losses):
            print(f"FAIL: the job reported {len(got_losses)} losses, the reference has {len(losses)}")
            return 1
        worst_loss = max(abs(g - w) / max(abs(w), 1e-30) for g, w in zip(got_losses, losses))
        ok = worst_loss <= a.loss_tolerance
        print(f"{'ok  ' if ok else 'FAIL'} loss curve vs PyTorch ({a.dtype}): max relative difference "
              f"{worst_loss:.3g} over {len(losses)} steps (bound {a.loss_tolerance}); pippy "
              f"{[round(x, 5) for x in got_losses]}, PyTorch {[round(x, 5) for x in losses]}")
        status = 0 if ok else 1
        got_lrs = reported.get("learning_rates", [])
        lr_ok = got_lrs == used_lrs
        print(f"{'ok  ' if lr_ok else 'FAIL'} learning rates ({a.lr_schedule}, warm-up {W}) equal torch's schedulers' "
              f"step for step: pippy {got_lrs[:3]}...{got_lrs[-2:]}, torch {used_lrs[:3]}...{used_lrs[-2:]}")
        status = status if lr_ok else 1
        if val is not None:
            got_evals = [(e.get("step", 0), e["loss"]) for e in reported.get("evals", [])]
            steps_ok = [g[0] for g in got_evals] == [w[0] for w in evals]
            worst_eval = max((abs(g[1] - w[1]) / max(abs(w[1]), 1e-30) for g, w in zip(got_evals, evals)),
                             default=float("inf"))
            eval_ok = steps_ok and worst_eval <= a.eval_tolerance
            print(f"{'ok  ' if eval_ok else 'FAIL'} evaluation losses vs the unsplit model's forward (eval mode, "
                  f"no_grad) on the same {a.eval_batches} validation batches: max relative difference "
                  f"{worst_eval:.3g} at steps {[g[0] for g in got_evals]} (PyTorch's at {[w[0] for w in evals]}); "
                  f"pippy {[round(g[1], 5) for g in got_evals]}, PyTorch {[round(w[1], 5) for w in evals]}")
            status = status if eval_ok else 1

    trained = torch.jit.load(a.trained, map_location=device)
    want = model.state_dict()
    got = trained.state_dict()
    if set(want) != set(got):
        print(f"FAIL: parameter names differ: {sorted(set(want) ^ set(got))}")
        return 1
    worst = 0.0
    for k, w in want.items():
        if not torch.is_floating_point(w):
            continue
        d = (got[k].double() - w.double()).abs().max().item()
        worst = max(worst, d / max(w.double().abs().max().item(), 1e-30))
    ok = worst <= a.tolerance
    print(f"{'ok  ' if ok else 'FAIL'} trained model vs plain PyTorch loop ({a.optimizer}, {a.dtype}, {a.steps} "
          f"steps): max relative difference {worst:.3g} over {len(want)} tensors")
    return status if ok else 1


if __name__ == "__main__":
    sys.exit(main())
