#!/usr/bin/python3
"""Concurrent clients of a generation job (generate_test.sh), checked against references
computed here, in one process, from the same TorchScript file:

  generate_clients.py ADDR JOB MODEL gen_lm.py --clients 16 --seed S [--kill-after N]

Each client sends prompts of 3-40 tokens asking for 1-64 new tokens (greedy), through
the Python client's generate() iterator, and every sequence must equal
  (a) the unsplit model's greedy generation, one sequence at a time with the same cache
      contract (a prefill of the prompt, then one token per step: gen_lm.greedy_cached), and
  (b) full recomputation without a cache: the argmax of the last logits of the whole
      sequence through a fresh model at each step (gen_lm.greedy_recompute).
Prints one line per check and exits 1 if any sequence differs.
"""
import argparse
import importlib.util
import os
import random
import sys
import threading
import time

import torch


def load_module(path):
    spec = importlib.util.spec_from_file_location("gen_lm", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("addr")
    ap.add_argument("job")
    ap.add_argument("model")
    ap.add_argument("gen_lm")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=96)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
    import pippy

    gen = load_module(a.gen_lm)
    rng = random.Random(a.seed)
    work = []
    for c in range(a.clients):
        for _ in range(a.per_client):
            n = rng.randint(3, 40)
            work.append((c, [rng.randrange(a.vocab) for _ in range(n)], rng.randint(1, 64)))
    # The longest sequences first among the checks, so that all lengths are covered.
    got = {}
    errors = []
    lock = threading.Lock()
    start = time.monotonic()

    def client(c):
        with pippy.Client(a.addr, timeout_s=120) as cl:
            for i, (cc, prompt, new) in enumerate(work):
                if cc != c:
                    continue
                try:
                    it = cl.generate(a.job, prompt, max_new_tokens=new, timeout_s=300)
                    toks = list(it)
                    with lock:
                        got[i] = (toks, it.finish_reason, it.ttft_ms)
                except Exception as e:  # noqa: BLE001 - reported below
                    with lock:
                        errors.append(f"client {c} request {i}: {e}")

    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.monotonic() - start
    if errors or any(t.is_alive() for t in threads):
        print("FAIL:", errors[:5], "alive:", sum(t.is_alive() for t in threads))
        return 1
    model = torch.jit.load(a.model)
    model.eval()
    cached_bad = recompute_bad = reason_bad = 0
    tokens = 0
    for i, (c, prompt, new) in enumerate(work):
        toks, reason, _ = got[i]
        tokens += len(toks)
        want = gen.greedy_cached(model, prompt, new)
        if toks != want:
            cached_bad += 1
            if cached_bad <= 3:
                print(f"request {i} (prompt {len(prompt)} tokens, {new} new): got {toks} want {want}")
        if reason != "length" or len(toks) != new:
            reason_bad += 1
        # Recomputation is slow in Python: every request whose prompt+output is long, and a sample of the rest.
        if i % 2 == 0 or len(prompt) + new > 60:
            if toks != gen.greedy_recompute(a.model, prompt, new):
                recompute_bad += 1
    n = len(work)
    lens = sorted(len(p) for _, p, _ in work)
    news = sorted(k for _, _, k in work)
    print(f"{n} sequences from {a.clients} concurrent clients (prompts {lens[0]}-{lens[-1]} tokens, "
          f"{news[0]}-{news[-1]} new), {tokens} tokens in {wall:.1f} s: "
          f"{n - cached_bad}/{n} equal the cached greedy loop, {recompute_bad} differ from recomputation, "
          f"{reason_bad} with a wrong length or finish reason")
    return 0 if cached_bad == 0 and recompute_bad == 0 and reason_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
