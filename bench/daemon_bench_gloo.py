#!/usr/bin/python3
"""Python baseline for bench/daemon_bench.sh: the same MLP split in two halves on two
processes, torch.distributed with the gloo backend, non-blocking sends and blocking receives of activations
and gradients, GPipe or 1F1B over the same micro-batches. Prints samples/s.

usage: daemon_bench_gloo.py RANK WORLD PORT MODEL DATA SCHEDULE MICROBATCHES BATCH STEPS
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
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = torch.jit.load(model_path)
    layers = list(full.children())
    half = len(layers) // 2
    part = torch.nn.Sequential(*(layers[:half] if rank == 0 else layers[half:]))
    opt = torch.optim.SGD(part.parameters(), lr=1e-4)
    data = torch.load(data_path)
    x_all, y_all = data["inputs"][:batch], data["targets"][:batch]
    xs, ys = x_all.chunk(m), y_all.chunk(m)
    width = layers[half - 1].out_features if hasattr(layers[half - 1], "out_features") else x_all.shape[1]
    mb_shape = (batch // m, width)

    # Sends are posted without blocking (as pippy's are) and waited at the end of the
    # step; blocking sends deadlock 1F1B when both ranks send at once.
    pending = []

    def fwd(i, saved):
        if rank == 0:
            out = part(xs[i])
            buf = out.detach()
            pending.append((dist.isend(buf, 1), buf))
            saved[i] = out
        else:
            inp = torch.empty(mb_shape)
            dist.recv(inp, 0)
            inp.requires_grad_()
            out = part(inp)
            saved[i] = (inp, F.mse_loss(out, ys[i]) / m)

    def bwd(i, saved):
        if rank == 0:
            g = torch.empty(mb_shape)
            dist.recv(g, 1)
            saved.pop(i).backward(g)
        else:
            inp, loss = saved.pop(i)
            loss.backward()
            pending.append((dist.isend(inp.grad, 0), inp.grad))

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
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        print(f"{batch * steps / (time.perf_counter() - t0):.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
