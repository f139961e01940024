#!/usr/bin/python3
"""Trains a model on a pippy coordinator from Python and fetches the result.

usage: example.py COORDINATOR MODEL.pt DATA.pt OUT.pt [--stages 2] [--steps 5]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pippy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("coordinator")
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with pippy.Client(a.coordinator) as c:
        print(f"{len(c.workers())} workers")
        job = c.submit(a.model, a.data, stages=a.stages, schedule="1f1b", microbatches=4, batch_size=16,
                       steps=a.steps, loss="mse", optimizer="adamw", lr=1e-3)
        print(f"submitted {job}")
        for e in c.watch(job):
            loss = "-" if e["loss"] is None else f"{e['loss']:.4f}"  # None before the first step
            print(f"  {e['state']} step {e['step']}/{e['steps']} loss {loss}")
        record = c.wait(job)
        n = c.fetch(job, a.out)
        print(f"{job} {record['state']}: fetched {n} bytes to {a.out}")
        assert any(j["job_id"] == job for j in c.list_jobs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
