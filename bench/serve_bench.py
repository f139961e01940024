#!/usr/bin/python3
"""Serving: pippy's serving job against a single-process LibTorch forward of the
unsplit model, on this machine (bench/serve_bench.sh).

The load: N client threads, closed loop (each sends its next request when the last was
answered), requests of 1 row of an 8 x Linear(W) MLP, for S seconds per configuration.
Configurations, measured in the same run:

  libtorch b=1      one process (torch.jit.load, --threads threads) answering the queued
                    requests one at a time: forward of 1 row each.
  libtorch batched  the same process taking up to B queued requests at once (one forward
                    of up to B rows): dynamic batching without a pipeline.
  pippy sequential  a serving job on 2 workers x 1 thread with --max-batch 1
                    --max-inflight 1: each request alone through the pipeline, one after
                    the other (pipelining without micro-batches).
  pippy serving     the same workers with --max-batch B --max-delay-ms D: requests
                    batched into micro-batches that follow each other through the stages.

The LibTorch configurations serve in-process (no RPC): they are the bound a server in
front of one process could reach. The pippy ones go through gRPC (Python client ->
coordinator -> workers -> coordinator -> client). Prints requests/s, rows per forward,
p50/p99 latency, and each throughput as a ratio to libtorch b=1.

usage: serve_bench.py --bin BAZEL_BIN [--clients 16] [--seconds 5] [--width 1024]
                      [--max-batch 16] [--max-delay-ms 2] [--max-inflight 0] [--threads 2]
"""
import argparse
import io
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_bench import Daemons  # noqa: E402

import torch  # noqa: E402


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def closed_loop(n_clients, seconds, call):
    """N threads calling call(x) back to back; returns (answered, latencies in ms, wall s)."""
    lat = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    start = time.monotonic()

    def client(c):
        x = torch.randn(1, WIDTH)
        mine = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            call(x)
            mine.append((time.perf_counter() - t0) * 1000)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(lat), lat, time.monotonic() - start


class LocalServer:
    """One process's forward behind a queue: up to `batch` waiting requests per forward."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch
        self.q = queue.Queue()
        self.forwards = 0
        self.rows = 0
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while self.running:
            try:
                first = self.q.get(timeout=0.1)
            except queue.Empty:
                continue
            items = [first]
            while len(items) < self.batch:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            with torch.no_grad():
                y = self.model(torch.cat([x for x, _ in items]))
            self.forwards += 1
            self.rows += len(items)
            for i, (_, done) in enumerate(items):
                done.put(y[i:i + 1])

    def __call__(self, x):
        done = queue.Queue(maxsize=1)
        self.q.put((x, done))
        return done.get()

    def close(self):
        self.running = False
        self.thread.join()


def main():
    global WIDTH
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-delay-ms", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=0, help="pippy serving's (0: the job's default, stages + 1)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of the LibTorch process")
    a = ap.parse_args()
    WIDTH = a.width
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python"))
    import pippy

    tmp = tempfile.mkdtemp(prefix="serve_bench.")
    torch.manual_seed(0)
    mods = []
    for i in range(a.layers):
        mods.append(torch.nn.Linear(a.width, a.width))
        if i < a.layers - 1:
            mods.append(torch.nn.ReLU())
    model_path = f"{tmp}/mlp.pt"
    torch.jit.script(torch.nn.Sequential(*mods)).save(model_path)
    torch.save(torch.randn(4, a.width), f"{tmp}/example.pt")
    rows = []

    def record(name, answered, lat, wall, rows_per_forward):
        rows.append((name, answered / wall, rows_per_forward, percentile(lat, 0.5), percentile(lat, 0.99)))

    # LibTorch in this process.
    torch.set_num_threads(a.threads)
    model = torch.jit.load(model_path)
    model.eval()
    for batch, name in ((1, "libtorch b=1"), (a.max_batch, f"libtorch batched (<= {a.max_batch})")):
        server = LocalServer(model, batch)
        closed_loop(a.clients, 0.5, server)  # warm up
        server.forwards = server.rows = 0
        n, lat, wall = closed_loop(a.clients, a.seconds, server)
        record(name, n, lat, wall, server.rows / max(1, server.forwards))
        server.close()

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    d = Daemons(a.bin, tmp, env, workers=2)
    try:
        client = pippy.Client(f"127.0.0.1:{d.port}", timeout_s=60)
        for name, extra in (("pippy sequential (b=1, 1 in flight)", dict(max_batch=1, max_delay_ms=0, max_inflight=1)),
                            (f"pippy serving (<= {a.max_batch}, {a.max_delay_ms} ms)",
                             dict(max_batch=a.max_batch, max_delay_ms=a.max_delay_ms, max_inflight=a.max_inflight))):
            job = client.serve(model_path, f"{tmp}/example.pt", stages=2, name="bench", **extra)
            client.wait_serving(job)
            call = lambda x, job=job: client.infer(job, x)  # noqa: E731
            closed_loop(a.clients, 0.5, call)
            before = client.status(job).get("serving", {})
            n, lat, wall = closed_loop(a.clients, a.seconds, call)
            after = client.status(job).get("serving", {})
            mb = int(after.get("microbatches", 0)) - int(before.get("microbatches", 0))
            record(name, n, lat, wall, n / max(1, mb))
            client.cancel(job)
            for _ in range(100):
                if sum(w["state"] == "IDLE" for w in client.workers()) == 2:
                    break
                time.sleep(0.1)
        client.close()
    finally:
        d.stop()

    base = rows[0][1]
    print(f"serving: {a.layers} x Linear({a.width}), 1-row requests, {a.clients} closed-loop clients, "
          f"{a.seconds:g} s each; LibTorch process: {a.threads} thread(s); pippy: 2 stages on 2 workers x 1 thread")
    print(f"{'configuration':40s} {'requests/s':>11s} {'vs b=1':>7s} {'rows/forward':>13s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, rps, rpf, p50, p99 in rows:
        print(f"{name:40s} {rps:11.1f} {rps / base:7.2f} {rpf:13.1f} {p50:8.2f} {p99:8.2f}")


if __name__ == "__main__":
    main()
