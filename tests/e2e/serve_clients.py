"""Concurrent clients of a serving job, checked against the unsplit model's forward.

    serve_clients.py COORDINATOR JOB MODEL.pt --clients 32 --requests 6 [--stream]

Each client thread sends requests of mixed batch sizes (1-5 rows) and two sequence
lengths (bucketed into different micro-batches), through Client.infer (unary) or, with
--stream, half of them through Client.infer_stream. Some clients also send malformed
requests mixed in with good ones: token ids out of the vocabulary (the same dtype and
shape as good requests, so they share micro-batches with them and fail inside the
model), floats instead of int64, a wrong number of dimensions, and bytes that are not a
torch.save file. Every good request's output must equal the unsplit model's forward of
that request (max relative difference <= 1e-6); every bad one must fail with
INVALID_ARGUMENT naming the problem. Prints one line per check and a summary; exits 1 on
any failure.
"""
import argparse
import os
import sys
import threading

import grpc
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
import pippy  # noqa: E402


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("coordinator")
    ap.add_argument("job")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--vocab", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.jit.load(a.model)
    model.eval()
    failures = []
    lock = threading.Lock()
    counts = {"good": 0, "bad": 0, "worst": 0.0}

    def check_good(x, y, what):
        with torch.no_grad():
            want = model(x)
        d = rel_diff(y, want) if y.shape == want.shape else float("inf")
        with lock:
            counts["good"] += 1
            counts["worst"] = max(counts["worst"], d)
            if d > 1e-6:
                failures.append(f"{what}: output differs from the unsplit forward by {d} (shape {tuple(y.shape)})")

    def check_bad(err, expect, what):
        with lock:
            counts["bad"] += 1
            if not isinstance(err, pippy.PippyError) or err.code != grpc.StatusCode.INVALID_ARGUMENT or \
                    expect not in str(err):
                failures.append(f"{what}: wanted INVALID_ARGUMENT with {expect!r}, got {err!r}")

    def requests_of(c):
        out = []
        for r in range(a.requests):
            rows = 1 + (c + r) % 5
            t = 16 if (c + r) % 3 else 8
            x = torch.randint(0, a.vocab, (rows, t))
            kind = "good"
            if c % 8 == 3 and r == 2:
                x[rows - 1, t // 2] = a.vocab + 5  # out of the vocabulary: fails in the model
                kind = "bad:index out of range"
            elif c % 8 == 5 and r == 1:
                x = x.float()
                kind = "bad:is float32 but the model takes int64"
            elif c % 8 == 6 and r == 3:
                x = x[0]
                kind = "bad:has 1 dimensions"
            elif c % 8 == 7 and r == 4:
                x = b"this is not a torch.save file"
                kind = "bad:input"
            out.append((kind, x))
        return out

    def client(c):
        reqs = requests_of(c)
        with pippy.Client(a.coordinator, timeout_s=60) as cl:
            if a.stream and c % 2 == 1:
                answers = dict(cl.infer_stream(a.job, [x for _, x in reqs], timeout_s=120))
                if sorted(answers) != list(range(len(reqs))):
                    with lock:
                        failures.append(f"client {c}: stream answered {sorted(answers)}")
                    return
                results = [answers[i] for i in range(len(reqs))]
            else:
                results = []
                for _, x in reqs:
                    try:
                        results.append(cl.infer(a.job, x))
                    except pippy.PippyError as e:
                        results.append(e)
            for r, ((kind, x), y) in enumerate(zip(reqs, results)):
                what = f"client {c} request {r} ({kind})"
                if kind == "good":
                    if isinstance(y, Exception):
                        with lock:
                            failures.append(f"{what}: failed: {y}")
                    else:
                        check_good(x, y, what)
                else:
                    check_bad(y, kind.split(":", 1)[1], what)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in failures[:20]:
        print("FAIL", f)
    print(f"{a.clients} clients: {counts['good']} good requests (worst max relative difference {counts['worst']:.3g}), "
          f"{counts['bad']} malformed ones refused; {len(failures)} failures")
    sys.exit(1 if failures or counts["good"] == 0 else 0)


if __name__ == "__main__":
    main()
