"""Hostile models for the end-to-end tests (torch.jit.script reads the classes' source,
so they live in a file): hostile_models.py DIR writes

  DIR/hang.pt         a forward that never returns (while True in TorchScript)
  DIR/hog.pt          a forward that allocates 512 MiB after 512 MiB, keeping them
  DIR/wide.pt         Linear(4, 300000): 1.2 MB of output per row (a serving output that
                      outgrows a 2 MiB message at 2 rows)
  DIR/wide.input.pt   one row of its input
  DIR/small.data.pt   64 rows of [16] inputs and targets (for hang and hog)
"""
import sys
from typing import List

import torch

tmp = sys.argv[1]


class Hang(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        while bool(y.sum() > -1e30):
            y = y * 1.0
        return self.b(y)


class Hoard(torch.nn.Module):
    def forward(self, y):
        held: List[torch.Tensor] = []
        for i in range(100000):
            held.append(torch.zeros(1 << 27) + y.sum())  # depends on the input: not folded
            y = y + held[-1][i]
        return y + float(len(held))


class Hog(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.h, self.b = torch.nn.Linear(16, 16), Hoard(), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.h(self.a(x)))


torch.manual_seed(0)
torch.jit.script(Hang()).save(f"{tmp}/hang.pt")
torch.jit.script(Hog()).save(f"{tmp}/hog.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 300000))).save(f"{tmp}/wide.pt")
torch.save(torch.randn(1, 4), f"{tmp}/wide.input.pt")
torch.save({"inputs": torch.randn(64, 16), "targets": torch.randn(64, 16)}, f"{tmp}/small.data.pt")
