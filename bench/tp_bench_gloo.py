#!/usr/bin/python3
"""The peer for bench/tp_bench.sh: tensor parallelism written by hand in PyTorch over
torch.distributed's gloo backend, as Megatron-LM does it, with a GPipe pipeline around it.

The model (a Sequential of Linear / ReLU) is split into P contiguous parts; each part is
computed by T processes, its Linears alternately column-sharded (output features and
bias; the input's gradient all-reduced in backward) and row-sharded (input features; the
partial outputs all-reduced in forward, the bias added once). Process g = t * P + p holds
shard t of part p; activations and gradients go from shard t of part p to shard t of
part p + 1 (isend / recv). SGD after every step. Prints samples/s (process 0).

usage: tp_bench_gloo.py RANK WORLD PORT MODEL DATA P MICROBATCHES BATCH STEPS
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    model_path, data_path = sys.argv[4], sys.argv[5]
    P, m, batch, steps = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
    T = world // P
    t, p = divmod(rank, P)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group([s * P + q for s in range(T)]) for q in range(P)]  # every process makes every group
    tp_group = groups[p]

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous().clone()
            dist.all_reduce(g, group=tp_group)
            return g

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            dist.all_reduce(x, group=tp_group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    children = list(torch.jit.load(model_path).children())
    linears = [i for i, c in enumerate(children) if c.original_name == "Linear"]
    per_part = len(linears) // P
    begin = linears[p * per_part]
    end = linears[(p + 1) * per_part] if p + 1 < P else len(children)
    ops, params = [], []
    for i in range(begin, end):
        c = children[i]
        if c.original_name != "Linear":
            ops.append(("relu", None, None))
            continue
        col = linears.index(i) % 2 == 0
        w, b = c.weight.detach(), c.bias.detach()
        if col:
            w = w.chunk(T, 0)[t].clone().requires_grad_()
            b = b.chunk(T, 0)[t].clone().requires_grad_()
        else:
            w = w.chunk(T, 1)[t].clone().requires_grad_()
            b = b.clone().requires_grad_()
        ops.append(("col" if col else "row", w, b))
        params += [w, b]

    def part(x):
        for kind, w, b in ops:
            if kind == "relu":
                x = F.relu(x)
            elif kind == "col":
                x = F.linear(Copy.apply(x), w, b)
            else:
                x = Reduce.apply(F.linear(x, w)) + b
        return x

    opt = torch.optim.SGD(params, lr=1e-4)
    data = torch.load(data_path)
    xs, ys = data["inputs"][:batch].chunk(m), data["targets"][:batch].chunk(m)
    width = xs[0].shape[1]
    pending = []

    def step():
        saved = {}
        for i in range(m):  # GPipe: every forward, then every backward
            if p == 0:
                inp = xs[i]
            else:
                inp = torch.empty(batch // m, width)
                dist.recv(inp, t * P + p - 1)
                inp.requires_grad_()
            out = part(inp)
            if p == P - 1:
                saved[i] = (inp, F.mse_loss(out, ys[i]) / m)
            else:
                buf = out.detach()
                pending.append((dist.isend(buf, t * P + p + 1), buf))
                saved[i] = (inp, out)
        for i in range(m):
            inp, out = saved.pop(i)
            if p == P - 1:
                out.backward()
            else:
                g = torch.empty(batch // m, width)
                dist.recv(g, t * P + p + 1)
                out.backward(g)
            if p > 0:
                pending.append((dist.isend(inp.grad, t * P + p - 1), inp.grad))
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
