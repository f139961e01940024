#!/usr/bin/python3
"""Python baseline for bench/daemon_bench.sh: the same MLP split in two halves on two
processes, torch.distributed with the gloo backend, non-blocking sends and blocking receives of activations
and gradients, GPipe or 1F1B over the same micro-batches. Prints samples/s.

With REPLICAS R > 1 (bench/data_parallel_bench.py): WORLD = 2R processes, R copies of
the pipeline, each on a contiguous R-th of the batch (MICROBATCHES per replica), the
gradients of each half averaged across its replicas after the backward (one flat
bucket over gloo, as DDP does) before SGD steps.

usage: daemon_bench_gloo.py RANK WORLD PORT MODEL DATA SCHEDULE MICROBATCHES BATCH STEPS [REPLICAS]
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    model_path, data_path, schedule = sys.argv[4], sys.argv[5], sys.argv[6]
    m, batch, steps = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
    replicas = int(sys.argv[10]) if len(sys.argv) > 10 else 1
    replica, rank_in = divmod(rank, 2)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # One group per pipeline half: its replicas (every process creates every group).
    groups = [dist.new_group([r * 2 + p for r in range(replicas)]) for p in range(2)] if replicas > 1 else None
    first = replica * 2      # global rank of this replica's first half
    rank, world = rank_in, 2  # below: the rank within the pipeline
    full = torch.jit.load(model_path)
    layers = list(full.children())
    half = len(layers) // 2
    part = torch.nn.Sequential(*(layers[:half] if rank == 0 else layers[half:]))
    opt = torch.optim.SGD(part.parameters(), lr=1e-4)
    data = torch.load(data_path)
    part_rows = batch // replicas
    x_all = data["inputs"][:batch][replica * part_rows:(replica + 1) * part_rows]
    y_all = data["targets"][:batch][replica * part_rows:(replica + 1) * part_rows]
    xs, ys = x_all.chunk(m), y_all.chunk(m)
    width = layers[half - 1].out_features if hasattr(layers[half - 1], "out_features") else x_all.shape[1]
    mb_shape = (part_rows // m, width)

    # Sends are posted without blocking (as pippy's are) and waited at the end of the
    # step; blocking sends deadlock 1F1B when both ranks send at once.
    pending = []

    def fwd(i, saved):
        if rank == 0:
            out = part(xs[i])
            buf = out.detach()
            pending.append((dist.isend(buf, first + 1), buf))
            saved[i] = out
        else:
            inp = torch.empty(mb_shape)
            dist.recv(inp, first)
            inp.requires_grad_()
            out = part(inp)
            saved[i] = (inp, F.mse_loss(out, ys[i]) / m)

    def bwd(i, saved):
        if rank == 0:
            g = torch.empty(mb_shape)
            dist.recv(g, first + 1)
            saved.pop(i).backward(g)
        else:
            inp, loss = saved.pop(i)
            loss.backward()
            pending.append((dist.isend(inp.grad, first), inp.grad))

    def step():
        saved = {}
        if schedule == "gpipe":
            for i in range(m):
                fwd(i, saved)
            for i in range(m):
                bwd(i, saved)
        else:  # 1f1b
            warmup = min(world - rank - 1, m)
            for i in range(warmup):
                fwd(i, saved)
            for i in range(m - warmup):
                fwd(warmup + i, saved)
                bwd(i, saved)
            for i in range(m - warmup, m):
                bwd(i, saved)
        for work, _ in pending:
            work.wait()
        pending.clear()
        if groups is not None:
            params = [q for q in part.parameters() if q.grad is not None]
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            dist.all_reduce(flat, group=groups[rank_in])
            flat /= replicas
            off = 0
            for q in params:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q))
                off += q.numel()
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0 and replica == 0:
        print(f"{batch * steps / (time.perf_counter() - t0):.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
