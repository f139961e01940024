#!/usr/bin/python3
"""The daemons end to end against a Python peer, on this machine (bench/daemon_bench.sh).

For each geometry, R alternating runs of: pippy (a real pippy-coordinator and 2
pippy-worker processes, 1 compute thread each, UCX shared memory, jobs submitted with
pippyctl) and the peer (the same model, data, schedule and micro-batching in Python,
torch.distributed over gloo, 2 processes x 1 thread: bench/daemon_bench_gloo.py).
Throughput of a run: batch / mean step time over the steps after the first. The
ideal pipeline: the unsplit model's single-process, single-thread step time (full
batch, forward + backward + SGD step, measured here in the same run) x (m+p-1)/(m*p).
Efficiency = ideal step time / measured step time. Medians over the runs.

usage: daemon_bench.py --bin BAZEL_BIN [--runs 3] [--steps N] [--only NAME] [--trace FILE]
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

GEOMETRIES = [
    # name, width, layers, batch, microbatches, schedules, steps per run (~5 s of work)
    ("compute-bound", 2048, 8, 512, 8, ["gpipe", "1f1b"], 6),
    ("overhead-bound", 256, 8, 64, 16, ["1f1b"], 200),
]
P = 2


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def make_model(tmp, name, width, layers, batch):
    subprocess.run(["/usr/bin/python3", "-c", f"""
import torch
torch.manual_seed(0)
mods = []
for i in range({layers}):
    mods.append(torch.nn.Linear({width}, {width}))
    if i < {layers} - 1:
        mods.append(torch.nn.ReLU())
torch.jit.script(torch.nn.Sequential(*mods)).save("{tmp}/{name}.pt")
torch.save({{"inputs": torch.randn({batch}, {width}), "targets": torch.randn({batch}, {width})}}, "{tmp}/{name}.data.pt")
"""], check=True)


def single_process_step(tmp, name, steps, env):
    out = subprocess.run(["/usr/bin/python3", "-c", f"""
import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
model = torch.jit.load("{tmp}/{name}.pt")
data = torch.load("{tmp}/{name}.data.pt")
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
def step():
    F.mse_loss(model(data["inputs"]), data["targets"]).backward(); opt.step(); opt.zero_grad()
step()
t0 = time.perf_counter()
for _ in range({steps}): step()
print((time.perf_counter() - t0) / {steps})
"""], check=True, capture_output=True, text=True, env=env)
    return float(out.stdout)


class Daemons:
    def __init__(self, bin_dir, tmp, env, workers=P):
        self.port = free_port()
        self.env = env
        self.logs = []
        self.procs = []
        self.start(f"{bin_dir}/coordinator/pippy-coordinator", "--bind", "127.0.0.1", "--port", str(self.port),
                   "--state-dir", f"{tmp}/state", log=f"{tmp}/coordinator.log")
        for i in range(workers):
            self.start(f"{bin_dir}/worker/pippy-worker", "--coordinator", f"127.0.0.1:{self.port}", "--name",
                       f"w{i}", "--threads", "1", "--ucx-tls", "sm,self", "--replica-host", "127.0.0.1",
                       log=f"{tmp}/worker{i}.log")
        self.ctl = [f"{bin_dir}/client/pippyctl", "--coordinator", f"127.0.0.1:{self.port}"]
        for _ in range(200):
            r = subprocess.run(self.ctl + ["workers", "--output", "json"], capture_output=True, text=True)
            if r.returncode == 0 and sum(w["state"] == "IDLE" for w in json.loads(r.stdout).get("workers", [])) == workers:
                return
            time.sleep(0.1)
        raise RuntimeError("workers did not register")

    def start(self, *cmd, log):
        f = open(log, "a")
        self.logs.append(f)
        self.procs.append(subprocess.Popen(list(cmd), stdout=f, stderr=f, env=self.env))

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()


def pippy_run(d, tmp, name, schedule, m, batch, steps, replicas=1):
    r = subprocess.run(d.ctl + ["submit", f"{tmp}/{name}.pt", "--data", f"{tmp}/{name}.data.pt", "--stages", str(P),
                                "--schedule", schedule, "--microbatches", str(m), "--batch-size", str(batch),
                                "--steps", str(steps + 1), "--loss", "mse", "--optimizer", "sgd", "--lr", "1e-4",
                                "--replicas", str(replicas), "--wait", "--output", "json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pippy job failed: {r.stderr}")
    job = json.loads(r.stdout.splitlines()[0])["job_id"]
    j = json.loads(subprocess.run(d.ctl + ["status", job, "--output", "json"], capture_output=True,
                                  text=True).stdout)
    times = [float(t) for t in j["step_seconds"]][1:]  # the first step warms up
    return batch / statistics.mean(times), job, j


def gloo_peers(script, world, args, env):
    """Runs `script RANK WORLD PORT ARGS...` as `world` torch.distributed processes over
    gloo on 127.0.0.1; returns what rank 0 printed (samples/s) as a float."""
    port = free_port()
    others = [subprocess.Popen(["/usr/bin/python3", script, str(r), str(world), str(port)] + args, env=env,
                               stdout=subprocess.DEVNULL) for r in range(1, world)]
    out = subprocess.run(["/usr/bin/python3", script, "0", str(world), str(port)] + args,
                         env=env, capture_output=True, text=True, check=True)
    for o in others:
        o.wait(timeout=600)
    return float(out.stdout)


def gloo_run(bench_dir, tmp, name, schedule, m, batch, steps, env, replicas=1):
    args = [f"{tmp}/{name}.pt", f"{tmp}/{name}.data.pt", schedule, str(m), str(batch), str(steps), str(replicas)]
    return gloo_peers(f"{bench_dir}/daemon_bench_gloo.py", P * replicas, args, env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: per geometry)")
    ap.add_argument("--only", default="")
    ap.add_argument("--trace", default="", help="write the last pippy run's trace (Chrome JSON) here")
    a = ap.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    tmp = tempfile.mkdtemp(prefix="pippy-daemonbench-")
    rows = []
    d = Daemons(a.bin, tmp, env)
    try:
        for name, width, layers, batch, m, schedules, steps in GEOMETRIES:
            if a.only and a.only != name:
                continue
            steps = a.steps or steps
            make_model(tmp, name, width, layers, batch)
            for schedule in schedules:
                ideal_runs, pippy_runs, gloo_runs = [], [], []
                last_job = None
                for run in range(a.runs):
                    # Alternate: single process, pippy, gloo, so that drifts of the
                    # machine hit all three alike.
                    t1 = single_process_step(tmp, name, steps, env)
                    ideal_runs.append(t1 * (m + P - 1) / (m * P))
                    sps, last_job, job = pippy_run(d, tmp, name, schedule, m, batch, steps)
                    pippy_runs.append(sps)
                    gloo_runs.append(gloo_run(bench_dir, tmp, name, schedule, m, batch, steps, env))
                    print(f"  {name} {schedule} run {run + 1}: ideal {batch / ideal_runs[-1]:.0f} samples/s, "
                          f"pippy {pippy_runs[-1]:.0f}, gloo {gloo_runs[-1]:.0f}", flush=True)
                ideal = statistics.median(ideal_runs)
                pippy = statistics.median(pippy_runs)
                gloo = statistics.median(gloo_runs)
                breakdown = "; ".join(
                    f"rank {b.get('rank', 0)}: compute {b.get('compute_seconds', 0):.3f} wait "
                    f"{b.get('wait_seconds', 0):.3f} transport {b.get('transport_seconds', 0):.3f} optimizer "
                    f"{b.get('optimizer_seconds', 0):.3f} other {b.get('other_seconds', 0):.3f}"
                    for b in job.get("breakdown", []))
                rows.append((name, width, layers, batch, m, schedule, batch / ideal, pippy, gloo,
                             (batch / pippy) and ideal / (batch / pippy), breakdown))
                if a.trace:
                    subprocess.run(d.ctl + ["trace", last_job, "-o", a.trace], capture_output=True)
    finally:
        d.stop()
    cores = os.cpu_count()
    print(f"\n{cores} cores; {P} workers x 1 thread, UCX sm; peer: torch.distributed gloo, {P} processes x 1 thread; "
          f"median of {a.runs} alternating runs, each {'%d steps' % a.steps if a.steps else '6 (compute) / 200 (overhead) steps'} after a warm-up step")
    print(f"{'geometry':15s} {'model':>13s} {'batch':>5s} {'m':>3s} {'schedule':8s} {'ideal/s':>8s} "
          f"{'pippy/s':>8s} {'gloo/s':>8s} {'efficiency':>10s} {'pippy/gloo':>10s}")
    for name, width, layers, batch, m, schedule, ideal, pippy, gloo, eff, _ in rows:
        print(f"{name:15s} {f'{layers}x{width}':>13s} {batch:5d} {m:3d} {schedule:8s} {ideal:8.0f} {pippy:8.0f} "
              f"{gloo:8.0f} {eff:10.2f} {pippy / gloo:9.2f}x")
    print("\nlast step's breakdown per rank (seconds):")
    for name, _, _, _, _, schedule, *_, breakdown in rows:
        print(f"  {name} {schedule}: {breakdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
