#!/usr/bin/python3
"""A stage's training throughput in pippy vs the same computation in a PyTorch loop.

usage: gpu_stage_bench.py MODEL.pt DATA.pt JOB.json [--device cuda|cpu]

JOB.json is `pippyctl status JOB --output json` of a finished 1-stage training job with
mse loss and sgd (scripts/gpu-check runs one): its per-step times (the slowest rank's
step_seconds) against a PyTorch loop doing what the worker does each step — the batch
copied from host memory to the device, M micro-batches of forward and backward (loss /
M), the optimizer step — timed with the device synchronised. Medians over the steps
after the first 3 (warm-up). Prints a small table; the last line is the ratio
pippy / PyTorch in samples per second.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("job")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    spec = job["spec"]
    steps, batch = int(spec["steps"]), int(spec["batch_size"])
    m = int(spec["schedule"]["microbatches"])
    lr = float(spec.get("optimizer", {}).get("lr", 0.01))
    pippy_steps = [float(s) for s in job.get("step_seconds", [])]
    if len(pippy_steps) < 5 or job.get("state") != "SUCCEEDED":
        print(f"the job did not finish its steps: {job.get('state')} {job.get('reason', '')}")
        return 1
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    model = torch.jit.load(a.model, map_location=device)
    data = torch.load(a.data)
    x_all, y_all = data["inputs"], data["targets"]
    n = x_all.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % n
        start = time.perf_counter()
        x = x_all.index_select(0, idx).to(device)
        y = y_all.index_select(0, idx).to(device)
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            loss = F.mse_loss(model(xc), yc)
            (loss / m).backward()
            loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    ref = statistics.median(times[3:])
    got = statistics.median(pippy_steps[3:])
    print(f"{'':24}{'step ms':>10}{'samples/s':>12}")
    print(f"{'pippy (1-stage job)':24}{got * 1e3:10.2f}{batch / got:12.1f}")
    print(f"{'PyTorch loop':24}{ref * 1e3:10.2f}{batch / ref:12.1f}")
    print(f"{ref / got:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
