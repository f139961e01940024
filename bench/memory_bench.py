#!/usr/bin/python3
"""Peak memory (VmHWM) of every pippy process for one large-model job, beside the
model's and the stages' sizes and the budgets they are held to.

Starts a real pippy-coordinator and W real pippy-worker processes on 127.0.0.1, makes a
model of L x Linear(H, H) + ReLU with /usr/bin/python3, submits it with pippyctl
(--stages W, 1F1B), waits for it, fetches the trained model, and reads each daemon's
/proc/PID/status VmHWM before stopping it; pippyctl's peaks are its children's
ru_maxrss. Also times submit, placement (PLACING -> RUNNING) and fetch.

The coordinator prepares a submission and merges a trained model in child processes
(coordinator/child_process.h); their peaks (the coordinator logs them) are rows of
their own. Submit (`pippyctl submit --detach`: the job id once the upload is stored and
fsynced; the preparation follows, timed to QUEUED) is timed beside `cp` of the model
file into the state directory, with and without a sync; PLACING -> RUNNING beside the
same for a one-stage job of the largest stage's layers on one worker (the largest
stage sent alone), and beside a copy of that many bytes (same run).

Budgets:
  worker        <= (k + 0.2) x its stages' parameter bytes + 400 MB   (k = 3 SGD, 4 Adam/AdamW)
  coordinator   <= 400 MiB + 2 x the model's largest tensor (flat in the model's size)
  its children  <= the largest stage + 2 x the largest tensor + 400 MiB (preparing and
                   merging record by record: one stage's records at a time)
  pippyctl      <= 150 MB, any model size

usage: memory_bench.py --bin BAZEL_BIN [--layers 16] [--hidden 4096] [--workers 4]
                       [--optimizer adamw] [--steps 2] [--batch 32] [--microbatches 4]
                       [--tensor-parallel T]

--tensor-parallel T: every stage sharded across T workers (the Linears alternately colwise
and rowwise); each worker's budget counts its shard (a T-th of the stage's sharded
parameters, the replicated ones whole), and its row says what it loaded against its
stage's parameters (1/T expected, plus the replicated biases of rowwise Linears).
"""
import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python"))
from pippy import TERMINAL  # noqa: E402  the job states after which nothing changes (proto/coordinator.proto)

MB = 1 << 20


def vm_hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_measured(cmd, env):
    """Runs cmd in a fresh child of a fresh Python (so ru_maxrss is this command's)."""
    probe = ("import resource,subprocess,sys,json,time;t=time.perf_counter();"
             "r=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
             "print(json.dumps({'rc':r.returncode,'out':r.stdout,'err':r.stderr,"
             "'seconds':time.perf_counter()-t,"
             "'maxrss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024}))")
    r = subprocess.run([sys.executable, "-c", probe] + cmd, capture_output=True, text=True, env=env)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="bazel-bin of a build of //client:pippyctl //coordinator:all //worker:all")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--fetches", type=int, default=1,
                    help="fetch the trained model this many times (pippyctl's peak: the largest; all printed)")
    ap.add_argument("--tmp", default=None, help="work folder (default: a new one under /tmp)")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="T ranks per stage (T x the workers): the Linears alternately colwise and rowwise")
    a = ap.parse_args()
    T = a.tensor_parallel
    nprocs = a.workers * T
    tp_flags = []
    if T > 1:
        plan = ",".join(f"{2 * i}={'colwise' if i % 2 == 0 else 'rowwise'}" for i in range(a.layers))
        tp_flags = ["--tensor-parallel", str(T), "--tp-plan", plan]

    tmp = a.tmp or tempfile.mkdtemp(prefix="pippy-membench-")
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    model = f"{tmp}/model.pt"
    t0 = time.perf_counter()
    subprocess.run(["/usr/bin/python3", "-c", f"""
import torch
torch.manual_seed(0)
layers = []
for _ in range({a.layers}):
    layers += [torch.nn.Linear({a.hidden}, {a.hidden}), torch.nn.ReLU()]
torch.jit.script(torch.nn.Sequential(*layers)).save("{model}")
# The reference for placement: one stage's worth of the model, sent alone to one worker.
torch.jit.script(torch.nn.Sequential(*layers[:2 * ({a.layers} // {a.workers})])).save("{model}.stage.pt")
"""], check=True, env=env)
    model_bytes = os.path.getsize(model)
    param_bytes = a.layers * (a.hidden * a.hidden + a.hidden) * 4
    print(f"model: {a.layers} x Linear({a.hidden}, {a.hidden}) + ReLU = {param_bytes / MB:.0f} MiB of parameters, "
          f"file {model_bytes / MB:.0f} MiB (made in {time.perf_counter() - t0:.1f} s); "
          f"{a.workers} stages x {T} tensor-parallel ranks on {nprocs} workers, 1f1b, {a.optimizer}, batch {a.batch}, "
          f"m={a.microbatches}, "
          f"{a.steps} steps", flush=True)

    port = free_port()
    coord_cmd = [f"{a.bin}/coordinator/pippy-coordinator", "--bind", "127.0.0.1", "--port", str(port),
                 "--state-dir", f"{tmp}/state", "--heartbeat-timeout-s", "60"]
    procs = {}
    logs = []
    try:
        log = open(f"{tmp}/coordinator.log", "w")
        logs.append(log)
        procs["coordinator"] = subprocess.Popen(coord_cmd, stdout=log, stderr=log, env=env)
        where = f"127.0.0.1:{port}"
        for i in range(nprocs):
            log = open(f"{tmp}/worker{i}.log", "w")
            logs.append(log)
            procs[f"worker {i}"] = subprocess.Popen(
                [f"{a.bin}/worker/pippy-worker", "--coordinator", where, "--name", f"w{i}", "--threads", "1",
                 "--ucx-tls", "sm,self", "--wait-timeout-s", "600"], stdout=log, stderr=log, env=env)
        ctl = [f"{a.bin}/client/pippyctl", "--coordinator", where]
        for _ in range(200):
            r = subprocess.run(ctl + ["workers", "--output", "json"], capture_output=True, text=True)
            if r.returncode == 0 and sum(1 for w in json.loads(r.stdout or "{}").get("workers", [])
                                         if w["state"] == "IDLE") == nprocs:
                break
            time.sleep(0.1)

        # The references: copying the model into the state directory's file system, and
        # copying the largest stage file (measured after the job, below).
        t = time.perf_counter()
        shutil.copyfile(model, f"{tmp}/state/model-copy.pt")
        cp_only_s = time.perf_counter() - t
        os.sync()
        cp_model_s = time.perf_counter() - t
        os.remove(f"{tmp}/state/model-copy.pt")
        os.sync()
        spec = f"inputs=float32[{a.batch * 4},{a.hidden}];targets=float32[{a.batch * 4},{a.hidden}];seed=0"
        submit = run_measured(ctl + ["submit", model, "--synthetic", spec, "--stages", str(a.workers), "--schedule",
                                     "1f1b", "--microbatches", str(a.microbatches), "--batch-size", str(a.batch),
                                     "--steps", str(a.steps), "--loss", "mse", "--optimizer", a.optimizer,
                                     "--lr", "1e-4", "--detach"] + tp_flags, env)
        if submit["rc"] != 0:
            print("submit failed:", submit["err"])
            return 1
        job = submit["out"].strip()
        t_submitted = time.perf_counter()
        seen = {}
        state = None
        while True:
            r = subprocess.run(ctl + ["status", job, "--output", "json"], capture_output=True, text=True)
            j = json.loads(r.stdout)
            state = j["state"]
            seen.setdefault(state, time.perf_counter() - t_submitted)
            if state in TERMINAL:
                break
            time.sleep(0.1)
        if state != "SUCCEEDED":
            print(f"job {job} {state}: {j.get('reason', '')}")
            return 1
        fetches = []
        for _ in range(max(1, a.fetches)):
            fetch = run_measured(ctl + ["fetch", job, "-o", f"{tmp}/trained.pt"], env)
            if fetch["rc"] != 0:
                print("fetch failed:", fetch["err"])
                return 1
            fetches.append(fetch)
        if len(fetches) > 1:
            print("pippyctl fetch peaks (MiB): " + ", ".join(f"{f['maxrss'] / MB:.0f}" for f in fetches) +
                  "; seconds: " + ", ".join(f"{f['seconds']:.1f}" for f in fetches))
        fetch = max(fetches, key=lambda f: f["maxrss"])
        stage_params = [int(s.get("param_bytes", 0)) for s in j["plan"]["stages"]]
        stage_files = [int(b) for b in j.get("stage_file_bytes", [])]
        workers = json.loads(subprocess.run(ctl + ["workers", "--output", "json"], capture_output=True,
                                            text=True).stdout)["workers"]
        stages_of = {w["name"]: [int(s) for s in w.get("stages", [])] for w in workers}
        loaded_of = {w["name"]: int(w.get("loaded_param_bytes", 0)) for w in workers}
        # What one rank of a stage holds: its shard (a T-th of each sharded tensor) and
        # every replicated tensor whole.
        stage_rank_bytes = []
        for s in j["plan"]["stages"]:
            params = s.get("parameters", [])
            stage_rank_bytes.append(sum(int(p.get("bytes", 0)) // (T if "tp_dim" in p else 1) for p in params)
                                    if T > 1 and params else int(s.get("param_bytes", 0)))
        peaks = {name: vm_hwm(p.pid) for name, p in procs.items()}
        largest_stage = max(stage_files) if stage_files else 0
        # The largest stage sent alone: a one-stage job of that stage's layers on one
        # worker (the others idle), PLACING -> RUNNING timed the same way.
        alone = subprocess.run(ctl + ["submit", f"{model}.stage.pt", "--synthetic", spec, "--stages", "1",
                                      "--schedule", "gpipe", "--microbatches", str(a.microbatches), "--batch-size",
                                      str(a.batch), "--steps", "1", "--loss", "mse", "--optimizer", a.optimizer,
                                      "--lr", "1e-4"], capture_output=True, text=True, env=env)
        alone_seen = {}
        alone_job = None
        if alone.returncode == 0:
            alone_job = alone.stdout.strip()
            t_alone = time.perf_counter()
            while True:
                r = subprocess.run(ctl + ["status", alone_job, "--output", "json"], capture_output=True, text=True)
                st = json.loads(r.stdout)["state"]
                alone_seen.setdefault(st, time.perf_counter() - t_alone)
                if st in TERMINAL:
                    break
                time.sleep(0.1)
        else:
            print("the one-stage reference job was refused:", alone.stderr)
        alone_s = alone_seen.get("RUNNING", float("nan")) - alone_seen.get("PLACING", 0)
        placing = seen.get('RUNNING', float('nan')) - seen.get('PLACING', 0)
        # The reference ran on a worker that had run a job before; the first job ran on
        # fresh processes (first LibTorch load, first touch of every buffer). The same
        # job again, on the same (now warm) workers, compares like with like.
        again = subprocess.run(ctl + ["submit", model, "--synthetic", spec, "--stages", str(a.workers), "--schedule",
                                      "1f1b", "--microbatches", str(a.microbatches), "--batch-size", str(a.batch),
                                      "--steps", "1", "--loss", "mse", "--optimizer", a.optimizer, "--lr", "1e-4",
                                      "--wait"] + tp_flags, capture_output=True, text=True, env=env)
        again_job = again.stdout.split()[0] if again.returncode == 0 and again.stdout.split() else None
        if again_job is None:
            print("the second job failed:", again.stdout, again.stderr)
        t = time.perf_counter()
        with open(f"{tmp}/stage-copy.pt", "wb") as out:
            with open(model, "rb") as src:  # the largest stage's size of bytes, read and written
                left = largest_stage
                while left > 0:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    out.write(chunk)
                    left -= len(chunk)
        os.sync()
        cp_stage_s = time.perf_counter() - t
        os.remove(f"{tmp}/stage-copy.pt")
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()

    k = 3 if a.optimizer == "sgd" else 4
    largest_tensor = a.hidden * a.hidden * 4
    with open(f"{tmp}/coordinator.log") as f:
        log_text = f.read()
    import re
    # PLACING -> RUNNING from the coordinator's own log lines (millisecond timestamps):
    # polling `pippyctl status` adds its start-up time to a span of a fraction of a second.
    from datetime import datetime

    def logged_span(job_id, begin, end):
        at = {}
        for stamp, what in re.findall(r"^(\S+) I coordinator job=" + re.escape(job_id) + r" (\w+)", log_text, re.M):
            at.setdefault(what, datetime.fromisoformat(stamp))
        if begin in at and end in at:
            return (at[end] - at[begin]).total_seconds()
        return None

    spans = {name: logged_span(job_id, "placing", "running") if job_id else None
             for name, job_id in (("first", job), ("alone", alone_job), ("again", again_job))}
    placing = spans["first"] if spans["first"] is not None else placing
    alone_s = spans["alone"] if spans["alone"] is not None else alone_s
    placing_again = spans["again"] if spans["again"] is not None else float("nan")
    children = {kind: int(m) * MB for kind, m in re.findall(r"(prepared|merged)[^\n]*in a child process[^\n]*peak resident memory (\d+) MiB", log_text)}
    rows = []
    rows.append(("coordinator", peaks["coordinator"], 400 * MB + 2 * largest_tensor,
                 f"model {model_bytes / MB:.0f} MiB, largest tensor {largest_tensor / MB:.0f} MiB"))
    for kind, label in (("prepared", "its preparing child"), ("merged", "its merging child")):
        if kind in children:
            rows.append((label, children[kind], largest_stage + 2 * largest_tensor + 400 * MB,
                         f"largest stage {largest_stage / MB:.0f} MiB of a {model_bytes / MB:.0f} MiB model"))
    for i in range(nprocs):
        own = sum(stage_rank_bytes[s] for s in stages_of.get(f"w{i}", []))
        whole = sum(stage_params[s] for s in stages_of.get(f"w{i}", []))
        held = (f"stage params {whole / MB:.0f} MiB, its shard {own / MB:.0f} MiB, loaded {loaded_of.get(f'w{i}', 0) / MB:.0f}"
                f" MiB = {loaded_of.get(f'w{i}', 0) / max(whole, 1):.3f} of the stage" if T > 1 else
                f"stage params {own / MB:.0f} MiB")
        rows.append((f"worker {i} (stages {','.join(map(str, stages_of.get(f'w{i}', [])))})", peaks[f"worker {i}"],
                     (k + 0.2) * own + 400 * MB, held))
    rows.append(("pippyctl submit", submit["maxrss"], 150 * MB, f"streams {model_bytes / MB:.0f} MiB"))
    rows.append(("pippyctl fetch", fetch["maxrss"], 150 * MB, f"writes {os.path.getsize(tmp + '/trained.pt') / MB:.0f} MiB"))
    print(f"\n{'process':34s} {'peak RSS':>10s} {'budget':>10s} {'ratio':>7s}  {'':4s} sizes")
    worst = 0
    for name, peak, budget, sizes in rows:
        ratio = peak / budget
        worst = max(worst, ratio)
        print(f"{name:34s} {peak / MB:8.0f} MiB {budget / MB:8.0f} MiB {ratio:7.2f}  {'ok' if ratio <= 1 else 'OVER':4s} {sizes}")
    print(f"\nstage files: {', '.join(f'{b / MB:.0f} MiB' for b in stage_files)}")
    prepared = seen.get('QUEUED', seen.get('PLACING', float('nan')))
    print(f"submit (pippyctl submit --detach returns the job id; the upload fsynced) {submit['seconds']:.1f} s "
          f"against cp of the model into the state directory {cp_only_s:.1f} s, cp + sync {cp_model_s:.1f} s: "
          f"{submit['seconds'] / max(cp_model_s, 1e-9):.2f}x cp + sync, {submit['seconds'] / max(cp_only_s, 1e-9):.2f}x "
          f"cp (target 1.5x); prepared (QUEUED) {prepared:.1f} s after the id")
    print(f"PLACING -> RUNNING {placing:.1f} s ({a.workers} workers at once) against the largest stage "
          f"({largest_stage / MB:.0f} MiB) sent alone to one worker {alone_s:.1f} s: {placing / max(alone_s, 1e-9):.2f}x "
          f"(target 1.5x); cp of that many bytes {cp_stage_s:.1f} s; fetch {fetch['seconds']:.1f} s")
    # Each placement keeps a core busy (the coordinator reading and sending, the worker
    # receiving and loading): with more workers than cores on one host, the cores bound
    # how many go at once, so W stages cannot be placed in less than W / cores x alone.
    print(f"  the same job again on the same workers (warm, as the reference's) {placing_again:.1f} s: "
          f"{placing_again / max(alone_s, 1e-9):.2f}x alone")
    cores = os.cpu_count() or 1
    bound = alone_s * max(1.0, a.workers / cores)
    print(f"  with {a.workers} workers and the coordinator on {cores} cores, at best {bound:.1f} s "
          f"(alone x max(1, workers / cores)): first {placing / max(bound, 1e-9):.2f}x, again "
          f"{placing_again / max(bound, 1e-9):.2f}x that")
    print(f"state first seen (s after submit returned): " +
          ", ".join(f"{s} {t:.1f}" for s, t in sorted(seen.items(), key=lambda x: x[1])))
    # The fetched file is a TorchScript archive PyTorch opens (zip64 past 2 GiB), with
    # the submitted model's parameter names and shapes.
    check = subprocess.run(["/usr/bin/python3", "-c", f"""
import torch
a = dict(torch.jit.load("{model}").named_parameters())
b = dict(torch.jit.load("{tmp}/trained.pt").named_parameters())
assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
changed = sum(1 for k in a if not torch.equal(a[k], b[k]))
print(f"fetched model: torch.jit.load opens it; {{len(b)}} parameters, {{changed}} changed by training")
"""], capture_output=True, text=True, env=env)
    print(check.stdout.strip() or check.stderr.strip())
    if not a.tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if check.returncode == 0 and worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
