#!/usr/bin/python3
"""What `auto` chooses against a grid of hand-picked plans, on this machine (bench/autoplan_bench.sh).

A real pippy-coordinator and 2 pippy-worker processes (1 compute thread each, UCX
shared memory). For each model, every run submits the grid's plans (schedule x
micro-batches x stages, given by hand, the split by pippy's default balance) and one
job with --schedule auto --microbatches auto --stages auto, alternating, after one untimed job
(the workers' first steps of a model run cold). Throughput of
a job: batch / mean step time over the steps after the first. Medians over the runs.
Printed per model: each grid plan's measured samples/s and what the chooser predicted
for it (the prediction of the auto job's candidate with the same schedule, micro-batches
and stages: its cuts are the chooser's), then auto's choice, its prediction, its
measurement, and the ratios auto / best of the grid and predicted / measured.

usage: autoplan_bench.py --bin BAZEL_BIN [--runs 3] [--only NAME]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import daemon_bench as db  # noqa: E402

# The grid: (schedule, micro-batches, stages), 12 per model.
GRID = [("gpipe", 1, 1), ("gpipe", 2, 2), ("gpipe", 8, 2), ("1f1b", 2, 2), ("1f1b", 4, 2), ("1f1b", 8, 2),
        ("zb1p", 2, 2), ("zb1p", 4, 2), ("zb1p", 8, 2), ("interleaved-1f1b", 4, 4), ("interleaved-1f1b", 8, 4),
        ("zbv", 4, 4)]
SCHEDULE_ENUM = {"gpipe": "SCHEDULE_GPIPE", "1f1b": "SCHEDULE_1F1B", "zb1p": "SCHEDULE_ZB1P",
                 "interleaved-1f1b": "SCHEDULE_INTERLEAVED_1F1B", "zbv": "SCHEDULE_ZBV"}
ENUM_NAME = {v: k for k, v in SCHEDULE_ENUM.items()}

MODELS = {
    # name: (python that defines `model`, `inputs`, `targets`; batch; loss; steps per job)
    "mlp": ("""
mods = []
for i in range(8):
    mods.append(torch.nn.Linear(2048, 2048))
    if i < 7:
        mods.append(torch.nn.ReLU())
model = torch.nn.Sequential(*mods)
inputs, targets = torch.randn(256, 2048), torch.randn(256, 2048)
""", 256, "mse", 5),
    # Convolutions: few parameters, most of the FLOPs; then wide Linear layers: most
    # parameters, few FLOPs. A split by parameters puts every convolution on stage 0.
    "misleading": ("""
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU())])
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16 * 32 * 32, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    def forward(self, x):
        return self.head(self.convs(x))
model = Net()
inputs, targets = torch.randn(64, 16, 32, 32), torch.randn(64, 10)
""", 64, "mse", 5),
    "gpt": (None, 16, "model", 40),
}


def make(tmp, name, zoo):
    code, batch, _, _ = MODELS[name]
    if code is None:  # the zoo's GPT, its data doubled to 16 rows
        subprocess.run(["/usr/bin/python3", "-c", f"""
import shutil, torch
i, t = torch.load("{zoo}/gpt.input.pt"), torch.load("{zoo}/gpt.target.pt")
while i.shape[0] < {batch}:
    i, t = torch.cat([i, i]), torch.cat([t, t])
torch.save({{"inputs": i[:{batch}], "targets": t[:{batch}]}}, "{tmp}/{name}.data.pt")
shutil.copy("{zoo}/gpt.pt", "{tmp}/{name}.pt")
"""], check=True)
        return
    # From a file: torch.jit.script reads a class's source.
    with open(f"{tmp}/make_{name}.py", "w") as f:
        f.write(f"""
import torch
torch.manual_seed(0)
{code}
torch.jit.script(model).save("{tmp}/{name}.pt")
torch.save({{"inputs": inputs, "targets": targets}}, "{tmp}/{name}.data.pt")
""")
    subprocess.run(["/usr/bin/python3", f"{tmp}/make_{name}.py"], check=True)


def run_job(d, tmp, name, plan_args):
    _, batch, loss, steps = MODELS[name]
    args = d.ctl + ["submit", f"{tmp}/{name}.pt", "--data", f"{tmp}/{name}.data.pt", "--batch-size", str(batch),
                    "--steps", str(steps + 1), "--loss", loss, "--optimizer", "sgd", "--lr", "1e-4", "--wait",
                    "--output", "json"] + plan_args
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{name} {plan_args}: the job failed: {r.stderr}")
    job = json.loads(r.stdout.splitlines()[0])["job_id"]
    j = json.loads(subprocess.run(d.ctl + ["status", job, "--output", "json"], capture_output=True, text=True).stdout)
    times = [float(t) for t in j["step_seconds"]][1:]  # the first step warms up
    return batch / statistics.mean(times), j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    zoo = os.path.join(a.bin, "examples", "models", "zoo")
    tmp = tempfile.mkdtemp(prefix="pippy-autoplanbench-")
    names = [n for n in MODELS if not a.only or n == a.only]
    d = db.Daemons(a.bin, tmp, env, workers=2)
    summary = []
    try:
        for name in names:
            make(tmp, name, zoo)
            # A job first, not timed: the workers' first steps of a model run cold.
            run_job(d, tmp, name, ["--schedule", "1f1b", "--microbatches", "2", "--stages", "2"])
            grid = {g: [] for g in GRID}
            auto, chosen, predicted, candidates = [], [], [], {}
            for run in range(a.runs):
                for g in GRID:
                    schedule, m, stages = g
                    sps, _ = run_job(d, tmp, name, ["--schedule", schedule, "--microbatches", str(m), "--stages",
                                                    str(stages)])
                    grid[g].append(sps)
                sps, j = run_job(d, tmp, name, ["--schedule", "auto", "--microbatches", "auto", "--stages", "auto"])
                auto.append(sps)
                c = j["plan"]["choice"]["candidates"]
                w = c[0]
                chosen.append((ENUM_NAME.get(w["schedule"], w["schedule"]), w["microbatches"], w["stages"]))
                predicted.append(w["samples_per_second"])
                for x in c:
                    candidates.setdefault((ENUM_NAME.get(x["schedule"], x["schedule"]), x["microbatches"],
                                           x["stages"]), []).append(x["samples_per_second"])
                best = max(grid, key=lambda k: grid[k][-1])
                print(f"  {name} run {run + 1}: auto chose {chosen[-1]}: {sps:.1f}/s (predicted "
                      f"{predicted[-1]:.1f}); best of the grid {best}: {grid[best][-1]:.1f}/s", flush=True)
            _, batch, loss, steps = MODELS[name]
            print(f"\n{name}: batch {batch}, loss {loss}, SGD, {steps} steps after a warm-up step, 2 workers x 1 "
                  f"thread on {os.cpu_count()} cores; median of {a.runs} runs")
            print(f"  {'schedule':17s} {'m':>3s} {'stages':>6s} {'measured/s':>11s} {'predicted/s':>12s} {'pred/meas':>9s}")
            med = {g: statistics.median(v) for g, v in grid.items()}
            for g in GRID:
                p = statistics.median(candidates[g]) if g in candidates else None
                print(f"  {g[0]:17s} {g[1]:3d} {g[2]:6d} {med[g]:11.1f} "
                      f"{(f'{p:12.1f}' if p else '           -')} {(f'{p / med[g]:8.2f}x' if p else '        -')}")
            best = max(med, key=med.get)
            a_med, p_med = statistics.median(auto), statistics.median(predicted)
            most = max(set(chosen), key=chosen.count)
            print(f"  auto: chose {most} ({chosen.count(most)} of {len(chosen)} runs; all: {chosen}), measured "
                  f"{a_med:.1f}/s, predicted {p_med:.1f}/s")
            print(f"  auto / best of the grid ({best[0]} m={best[1]} stages={best[2]}: {med[best]:.1f}/s): "
                  f"{a_med / med[best]:.2f}x; predicted / measured: {p_med / a_med:.2f}x\n", flush=True)
            summary.append((name, most, a_med, p_med, best, med[best]))
    finally:
        d.stop()
    print(f"{'model':11s} {'auto chose':32s} {'auto/s':>8s} {'best grid/s':>11s} {'auto/best':>9s} {'pred/meas':>9s}")
    for name, most, a_med, p_med, best, b in summary:
        print(f"{name:11s} {str(most):32s} {a_med:8.1f} {b:11.1f} {a_med / b:8.2f}x {p_med / a_med:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
