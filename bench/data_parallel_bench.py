#!/usr/bin/python3
"""Data parallelism x pipeline parallelism on this machine (bench/data_parallel_bench.sh).

The same global batch trained by 1 pipeline of 2 workers (1 x 2) and by 2 replicas of
it on 4 workers (2 x 2, --replicas 2, gradients averaged over gloo), every worker 1
compute thread, the same micro-batch size; beside the peer: the same in Python
(torch.distributed over gloo: the 2-process pipeline of daemon_bench_gloo.py, and 2
copies of it with their gradients all-reduced after the backward as DDP does).
Alternating runs, medians; the ratio 2 x 2 / 1 x 2 for both, and pippy / peer.

usage: data_parallel_bench.py --bin BAZEL_BIN [--runs 3] [--steps 30] [--width 512] [--batch 256]
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import daemon_bench as db  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatch", type=int, default=32, help="rows per micro-batch, in both geometries")
    a = ap.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    tmp = tempfile.mkdtemp(prefix="pippy-dpbench-")
    name = "dp"
    db.make_model(tmp, name, a.width, a.layers, a.batch)
    results = {k: [] for k in ("pippy1", "pippy2", "gloo1", "gloo2")}
    breakdown = []
    d = db.Daemons(a.bin, tmp, env, workers=4)
    try:
        for run in range(a.runs):
            for replicas in (1, 2):
                m = a.batch // replicas // a.microbatch
                sps, _, job = db.pippy_run(d, tmp, name, "1f1b", m, a.batch, a.steps, replicas=replicas)
                results[f"pippy{replicas}"].append(sps)
                results[f"gloo{replicas}"].append(
                    db.gloo_run(bench_dir, tmp, name, "1f1b", m, a.batch, a.steps, env, replicas=replicas))
                if replicas == 2:
                    breakdown = job.get("breakdown", [])
            print(f"  run {run + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()), flush=True)
    finally:
        d.stop()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{os.cpu_count()} cores; {a.layers} x Linear({a.width}), global batch {a.batch}, micro-batches of "
          f"{a.microbatch} rows, 1F1B, SGD; every worker / process 1 thread; median of {a.runs} alternating runs, "
          f"{a.steps} steps each")
    print(f"{'':8s} {'1 x 2 /s':>9s} {'2 x 2 /s':>9s} {'2x2 / 1x2':>10s}")
    for who in ("pippy", "gloo"):
        print(f"{who:8s} {med[who + '1']:9.0f} {med[who + '2']:9.0f} {med[who + '2'] / med[who + '1']:9.2f}x")
    print(f"pippy / gloo: 1 x 2 {med['pippy1'] / med['gloo1']:.2f}x, 2 x 2 {med['pippy2'] / med['gloo2']:.2f}x")
    print("2 x 2, last step per rank (seconds): " + "; ".join(
        f"rank {b.get('rank', 0)} (replica {b.get('replica', 0)}): compute {b.get('compute_seconds', 0):.3f} wait "
        f"{b.get('wait_seconds', 0):.3f} all-reduce {b.get('allreduce_seconds', 0):.3f} (waited "
        f"{b.get('allreduce_wait_seconds', 0):.3f})" for b in breakdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
