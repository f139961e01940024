#!/usr/bin/python3
"""Tensor shards for dataset_test.cc, written by torch.save as users write them.

usage: make_tensor_shards.py OUT_DIR
  OUT_DIR/rows/{a,b,c}.pt   rows 0-4, 5-7, 8-11: inputs row r = [r, r + 0.5, r + 0.25], targets r
  OUT_DIR/mixed/{a,b}.pt    a float32 and a float64 shard (columns that differ)
  OUT_DIR/named/{a,b}.pt    inputs as a dict by forward()'s argument name "x"
"""
import os
import sys

import torch


def rows(begin, n):
    r = torch.arange(begin, begin + n, dtype=torch.float32).unsqueeze(1)
    return torch.cat([r, r + 0.5, r + 0.25], 1).contiguous(), torch.arange(begin, begin + n)


out = sys.argv[1]
for d in ("rows", "mixed", "named"):
    os.makedirs(os.path.join(out, d), exist_ok=True)
for name, begin, n in (("a", 0, 5), ("b", 5, 3), ("c", 8, 4)):
    x, y = rows(begin, n)
    torch.save({"inputs": x, "targets": y}, os.path.join(out, "rows", f"{name}.pt"))
torch.save({"inputs": torch.zeros(4, 3), "targets": torch.zeros(4, dtype=torch.long)}, os.path.join(out, "mixed", "a.pt"))
torch.save({"inputs": torch.zeros(4, 3, dtype=torch.float64), "targets": torch.zeros(4, dtype=torch.long)},
           os.path.join(out, "mixed", "b.pt"))
for name, begin, n in (("a", 0, 5), ("b", 5, 3)):
    x, y = rows(begin, n)
    torch.save({"inputs": {"x": x}, "targets": y}, os.path.join(out, "named", f"{name}.pt"))
