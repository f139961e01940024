#!/usr/bin/python3
"""Tensor parallelism on the daemons against a hand-written PyTorch peer (bench/tp_bench.sh).

For P = 1 x T = 2 and P = 2 x T = 2: R alternating runs of pippy (a real coordinator and
P x T workers, 1 compute thread each, UCX shared memory; the job submitted with
--tensor-parallel T --tp-plan, the Linears alternately colwise and rowwise, GPipe) and the
peer (bench/tp_bench_gloo.py: the same sharding written by hand, torch.distributed gloo,
P x T processes x 1 thread). Throughput of a run: batch / mean step time after the first
step. Medians over the runs; the tensor-parallel all-reduce time per step from the last
pippy run's breakdown (each rank's, inside its compute).

usage: tp_bench.py --bin BAZEL_BIN [--runs 3] [--steps 6] [--width 2048] [--layers 8]
                   [--batch 256] [--microbatches 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_bench import Daemons, gloo_peers, make_model  # noqa: E402


def plan(layers):
    return ",".join(f"{2 * i}={'colwise' if i % 2 == 0 else 'rowwise'}" for i in range(layers))


def pippy_run(d, tmp, P, T, a):
    r = subprocess.run(d.ctl + ["submit", f"{tmp}/m.pt", "--data", f"{tmp}/m.data.pt", "--stages", str(P),
                                "--schedule", "gpipe", "--microbatches", str(a.microbatches), "--batch-size",
                                str(a.batch), "--steps", str(a.steps + 1), "--loss", "mse", "--optimizer", "sgd",
                                "--lr", "1e-4", "--tensor-parallel", str(T), "--tp-plan", plan(a.layers), "--wait",
                                "--output", "json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pippy job failed: {r.stderr}")
    job = json.loads(r.stdout.splitlines()[0])["job_id"]
    j = json.loads(subprocess.run(d.ctl + ["status", job, "--output", "json"], capture_output=True,
                                  text=True).stdout)
    times = [float(s) for s in j["step_seconds"]][1:]
    return a.batch / statistics.mean(times), j


def peer_run(bench_dir, tmp, P, T, a, env):
    args = [f"{tmp}/m.pt", f"{tmp}/m.data.pt", str(P), str(a.microbatches), str(a.batch), str(a.steps)]
    return gloo_peers(f"{bench_dir}/tp_bench_gloo.py", P * T, args, env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    tmp = tempfile.mkdtemp(prefix="pippy-tpbench-")
    make_model(tmp, "m", a.width, a.layers, a.batch)
    rows = []
    d = Daemons(a.bin, tmp, env, workers=4)
    try:
        for P, T in ((1, 2), (2, 2)):
            pippy_runs, peer_runs = [], []
            job = {}
            for run in range(a.runs):
                sps, job = pippy_run(d, tmp, P, T, a)
                pippy_runs.append(sps)
                peer_runs.append(peer_run(bench_dir, tmp, P, T, a, env))
                print(f"  P={P} x T={T} run {run + 1}: pippy {pippy_runs[-1]:.0f} samples/s, peer {peer_runs[-1]:.0f}",
                      flush=True)
            step = statistics.mean(float(s) for s in job["step_seconds"][1:])
            ar = [(b.get("rank", 0), b.get("tp_rank", 0), float(b.get("tp_allreduce_seconds", 0)),
                   int(b.get("tp_allreduces", 0))) for b in job.get("breakdown", [])]
            rows.append((P, T, statistics.median(pippy_runs), min(pippy_runs), max(pippy_runs),
                         statistics.median(peer_runs), min(peer_runs), max(peer_runs), step, ar))
    finally:
        d.stop()
    print(f"\n{os.cpu_count()} cores; {a.layers} x Linear({a.width}) + ReLU, batch {a.batch}, m = {a.microbatches}, "
          f"GPipe, SGD; pippy: P x T workers x 1 thread, UCX sm, gloo groups; peer: torch.distributed gloo, "
          f"P x T processes x 1 thread; median of {a.runs} alternating runs (range), {a.steps} steps each after a warm-up")
    print(f"{'P x T':6s} {'pippy/s':>16s} {'peer/s':>16s} {'pippy/peer':>10s}  tensor-parallel all-reduce per step (pippy)")
    for P, T, pm, plo, phi, gm, glo, ghi, step, ar in rows:
        per = ", ".join(f"global rank {r} (shard {s}): {sec:.3f} s ({n}, {100 * sec / step:.0f}% of the step)"
                        for r, s, sec, n in ar)
        print(f"{P} x {T}  {pm:6.0f} ({plo:.0f}-{phi:.0f}) {gm:6.0f} ({glo:.0f}-{ghi:.0f}) {pm / gm:9.2f}x  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
