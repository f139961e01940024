#!/usr/bin/python3
"""Generation: a pippy generation job (2 stages on 2 workers) against one LibTorch process
running the same TorchScript model with the same KV-cache contract (bench/generate_bench.sh).

The load: C closed-loop clients (each sends its next prompt when its last sequence ended),
prompts of 8-32 tokens asking for 32-64 new tokens (greedy), for S seconds per
configuration, R runs each (medians printed). Configurations, in the same run:

  libtorch one-at-a-time  one process serving the waiting requests one after the other:
                          a prefill of the prompt, then one decode step per token, batch 1.
  libtorch batched        the same process with continuous batching: each step admits the
                          waiting requests into free slots (each prefilled alone: prompts
                          differ in length), then one decode step of every active sequence
                          together (batch = active sequences).
  pippy generate          pippyctl serve --generate in 2 stages on 2 workers x 1 thread:
                          continuous batching with 2 groups of sequences in flight, tokens
                          streamed over gRPC (Python client -> coordinator -> workers).

The LibTorch process serves in-process (no RPC) with --threads threads: the bound a server
in front of one process could reach on the same cores. Prints tokens/s, time to first
token and inter-token latency (p50/p99) and each throughput as a ratio to the batched
process; pippy's own breakdown (mean sequences per decode micro-batch) beside it.

usage: generate_bench.py --bin BAZEL_BIN [--clients 16] [--seconds 10] [--runs 3]
                         [--width 512] [--layers 8] [--threads 2]
"""
import argparse
import importlib.util
import os
import queue
import random
import statistics
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


class Load:
    """The closed-loop clients' requests, the same sequence of prompts for every configuration."""

    def __init__(self, vocab, seed):
        self.rng = random.Random(seed)
        self.vocab = vocab

    def next(self):
        n = self.rng.randint(8, 32)
        return [self.rng.randrange(self.vocab) for _ in range(n)], self.rng.randint(32, 64)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.tokens = 0
        self.ttft = []
        self.itl = []

    def sequence(self, arrival, token_times):
        with self.lock:
            self.tokens += len(token_times)
            if token_times:
                self.ttft.append((token_times[0] - arrival) * 1000)
            self.itl.extend((b - a) * 1000 for a, b in zip(token_times, token_times[1:]))


class LocalGenerator:
    """One process: requests from a queue, served with the model's cache contract."""

    def __init__(self, model, slots, batched):
        self.model, self.slots, self.batched = model, slots, batched
        self.q = queue.Queue()
        self.running = True
        self.decode_rows = []
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    @torch.no_grad()
    def prefill(self, seq):
        prompt = seq["prompt"]
        logits = self.model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0),
                            torch.tensor([seq["slot"]]))
        self.emit(seq, int(logits[0, -1].argmax()))

    def emit(self, seq, token):
        seq["out"].append(token)
        seq["times"].append(time.monotonic())
        if len(seq["out"]) >= seq["new"]:
            seq["done"].put(True)
            return True
        return False

    @torch.no_grad()
    def loop(self):
        active = []
        free = list(range(self.slots))
        while self.running:
            # Admit: one at a time unbatched, every waiting one that has a slot batched.
            while free and (self.batched or not active):
                try:
                    seq = self.q.get(timeout=0.01) if not active else self.q.get_nowait()
                except queue.Empty:
                    break
                seq["slot"] = free.pop()
                self.prefill(seq)
                if len(seq["out"]) >= seq["new"]:
                    free.append(seq["slot"])
                else:
                    active.append(seq)
            if not active:
                continue
            # One decode step of every active sequence together.
            idx = torch.tensor([[s["out"][-1]] for s in active])
            pos = torch.tensor([[len(s["prompt"]) + len(s["out"]) - 1] for s in active])
            slots = torch.tensor([s["slot"] for s in active])
            logits = self.model(idx, pos, slots)
            self.decode_rows.append(len(active))
            nxt = logits[:, -1].argmax(-1).tolist()
            still = []
            for s, t in zip(active, nxt):
                if self.emit(s, t):
                    free.append(s["slot"])
                else:
                    still.append(s)
            active = still

    def __call__(self, prompt, new):
        seq = {"prompt": prompt, "new": new, "out": [], "times": [], "done": queue.Queue(maxsize=1)}
        self.q.put(seq)
        seq["done"].get()
        return seq["times"]

    def close(self):
        self.running = False
        self.thread.join()


def closed_loop(n_clients, seconds, call, vocab):
    stats = Stats()
    stop = time.monotonic() + seconds
    start = time.monotonic()

    def client(c):
        load = Load(vocab, 1000 + c)
        while time.monotonic() < stop:
            prompt, new = load.next()
            arrival = time.monotonic()
            stats.sequence(arrival, call(prompt, new))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats, time.monotonic() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="compute threads of the LibTorch process")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python"))
    import pippy
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("gen_lm", os.path.join(here, "..", "examples", "models", "gen_lm.py"))
    gen_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_lm)

    tmp = tempfile.mkdtemp(prefix="generate_bench.")
    slots, max_seq = a.clients, 128
    torch.manual_seed(0)
    m = gen_lm.GenLM(a.vocab, a.width, a.heads, a.layers, slots, max_seq).eval()
    model_path = f"{tmp}/gen.pt"
    torch.jit.script(m).save(model_path)
    torch.save(gen_lm.example_input(slots), f"{tmp}/gen.input.pt")
    results = {}

    def record(name, stats, wall, extra=""):
        results.setdefault(name, []).append((stats.tokens / wall, percentile(stats.ttft, 0.5),
                                             percentile(stats.ttft, 0.99), percentile(stats.itl, 0.5),
                                             percentile(stats.itl, 0.99), extra))

    torch.set_num_threads(a.threads)
    model = torch.jit.load(model_path)
    model.eval()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    d = Daemons(a.bin, tmp, env, workers=2)
    try:
        client = pippy.Client(f"127.0.0.1:{d.port}", timeout_s=120)
        job = client.serve(model_path, f"{tmp}/gen.input.pt", stages=2, name="bench", generate=True)
        client.wait_serving(job)

        def pippy_call(prompt, new):
            times = []
            for _ in client.generate(job, prompt, max_new_tokens=new, timeout_s=300):
                times.append(time.monotonic())
            return times

        for run in range(a.runs):
            for batched, name in ((False, "libtorch one-at-a-time"), (True, "libtorch batched")):
                server = LocalGenerator(model, slots, batched)
                closed_loop(a.clients, 1.0 if run == 0 else 0.2, server, a.vocab)  # warm up
                server.decode_rows.clear()
                stats, wall = closed_loop(a.clients, a.seconds, server, a.vocab)
                rows = server.decode_rows
                record(name, stats, wall, f"{statistics.mean(rows) if rows else 0:.1f} seqs/decode step")
                server.close()
            closed_loop(a.clients, 1.0 if run == 0 else 0.2, pippy_call, a.vocab)
            before = client.status(job)["serving"].get("generation", {})
            stats, wall = closed_loop(a.clients, a.seconds, pippy_call, a.vocab)
            after = client.status(job)["serving"].get("generation", {})
            dm = int(after.get("decode_microbatches", 0)) - int(before.get("decode_microbatches", 0))
            record("pippy generate (2 stages)", stats, wall,
                   f"{float(after.get('mean_decode_rows', 0)):.1f} seqs/decode micro-batch, {dm} decode micro-batches")
        client.cancel(job)
        client.close()
    finally:
        d.stop()

    print(f"generation: GenLM {a.layers} layers x width {a.width} ({a.heads} heads, vocab {a.vocab}), "
          f"{a.clients} closed-loop clients (prompts 8-32 tokens, 32-64 new, greedy), {a.seconds:g} s x "
          f"{a.runs} runs (medians); LibTorch process: {a.threads} thread(s); pippy: 2 stages on 2 workers x 1 thread")
    print(f"{'configuration':28s} {'tokens/s (runs)':>24s} {'vs batched':>10s} {'TTFT p50':>9s} {'p99':>8s} "
          f"{'ITL p50':>8s} {'p99':>8s}  notes")
    med = {k: [statistics.median(x[i] for x in v) for i in range(5)] + [v[-1][5]] for k, v in results.items()}
    base = med["libtorch batched"][0]
    for name, (tps, t50, t99, i50, i99, extra) in med.items():
        runs = [x[0] for x in results[name]]
        tps_text = f"{tps:.1f} ({min(runs):.0f}-{max(runs):.0f})"
        print(f"{name:28s} {tps_text:>24s} {tps / base:10.2f} {t50:8.1f}ms {t99:6.1f}ms {i50:6.1f}ms {i99:6.1f}ms  "
              f"{extra}")
    # Run by run, pippy against the batched process of the same run.
    ratios = [p[0] / b[0] for p, b in zip(results["pippy generate (2 stages)"], results["libtorch batched"])]
    print("pippy / libtorch batched, run by run: " + ", ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
