#!/usr/bin/python3
"""Makes the test zoo of scripted models with PyTorch (run with /usr/bin/python3).

For every model NAME it writes, into --out:
  NAME.pt          torch.jit.script(model).save(...)
  NAME.input.pt    an example input saved with torch.save (a tensor, a tuple or a dict)
  NAME.target.pt   a target for training tests (same batch size as the input)
  NAME.data.pt     both, as a job's data file: {"inputs": ..., "targets": ...}

The models cover what the partitioner must handle:
  mlp         nn.Sequential of Linear/ReLU
  mlp_marked  the same with PipeSplit marker modules between layers
  gpt         GPT-like decoder: embedding, nn.ModuleList of blocks (attention, LayerNorm,
              residuals, dropout reading `training`), LM head tied to the embedding
  llama       Llama-like decoder for tensor parallelism: separate q/k/v/o projections (biases
              on q, v, o), `view(B, T, -1, head_dim)` (the head count follows the sharding, as
              torchtitan's Llama writes it), RMSNorm, a SwiGLU MLP (gate/up/down), untied head
  llama_fixed_heads  the same with the head count written into view() (a TP refusal case)
  unet        U-Net-like convnet with a skip connection from the first to the last level
  cnn_bn      ResNet-like CNN with BatchNorm in training mode and in-place ops
  multi       two inputs, tuple output, an int attribute, prim::If and prim::Loop
  iface       a submodule behind a module interface (cannot be inlined: an error case)
  gpt_deep    (only with --gpt-layers N) a deep, narrow GPT for benchmarks
"""
import argparse
import math
import os
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class PipeSplit(nn.Module):
    """Identity module that marks a pipeline cut (like torch's pipe_split())."""

    def forward(self, x):
        return x


def make_mlp(marked=False, width=32, layers=8):
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(nn.ReLU())
            if marked and i in (1, 4):
                mods.append(PipeSplit())
    return nn.Sequential(*mods)


class Attention(nn.Module):
    def __init__(self, d, n_head, max_len):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_head = n_head
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, n_head, max_len):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, max_len)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return x


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, n_head=4, n_layer=8, max_len=16):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, n_head, max_len) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied weights

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.jit.export
    def loss(self, output, target):
        return F.cross_entropy(output.view(-1, output.size(-1)), target.view(-1))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, d, n_head, max_len):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)  # a key bias has no gradient: softmax ignores a shift shared by all keys
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.n_head = n_head
        self.head_dim = d // n_head
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)))

    def forward(self, x):
        B, T, C = x.size()
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        return self.attend(q, x, B, T)

    def attend(self, q, x, B: int, T: int):
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.o(y)


class FixedHeadsAttention(LlamaAttention):
    """Writes the head count into view(): sharding q by columns cannot follow it."""

    def forward(self, x):
        B, T, C = x.size()
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        return self.attend(q, x, B, T)


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, d, n_head, max_len, fixed_heads):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = (FixedHeadsAttention if fixed_heads else LlamaAttention)(d, n_head, max_len)
        self.mlp_norm = RMSNorm(d)
        self.mlp = SwiGLU(d, 2 * d)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=64, d=32, n_head=4, n_layer=4, max_len=16, fixed_heads=False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([LlamaBlock(d, n_head, max_len, fixed_heads) for _ in range(n_layer)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    @torch.jit.export
    def loss(self, output, target):
        return F.cross_entropy(output.view(-1, output.size(-1)), target.view(-1))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down = nn.MaxPool2d(2)
        self.enc2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec1 = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.down(e1))
        m = self.mid(e2)
        u = self.up(m)
        d = self.dec1(torch.cat([u, e1], dim=1))
        return self.head(d)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return torch.relu_(out)


class CNN(nn.Module):
    def __init__(self, c=8, n_blocks=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(*[ResBlock(c) for _ in range(n_blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class Multi(nn.Module):
    n_iter: int

    def __init__(self):
        super().__init__()
        self.n_iter = 3
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(4, 16)
        self.d = nn.Linear(16, 16)
        self.e = nn.Linear(16, 8)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        for _ in range(self.n_iter):
            h = torch.tanh(self.b(h)) + h
        if bool(h.mean() > 0):
            h = h * 2.0
        else:
            h = h - 1.0
        g = self.c(y)
        if self.training:
            g = g + 0.5
        z = self.d(h * g)
        return self.e(z), z.sum(dim=1)

    @torch.jit.export
    def loss(self, output: Tuple[torch.Tensor, torch.Tensor], target: torch.Tensor):
        return F.mse_loss(output[0], target) + 0.01 * output[1].pow(2).mean()


@torch.jit.interface
class ModuleIface(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        pass


class Iface(nn.Module):
    impl: ModuleIface

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.impl = nn.Linear(4, 4)

    def forward(self, x):
        return self.impl(self.pre(x))


def zoo(gpt_layers):
    g = torch.Generator().manual_seed(1234)
    models = {}
    models["mlp"] = (make_mlp(), torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g))
    models["mlp_marked"] = (make_mlp(marked=True), torch.randn(16, 32, generator=g),
                            torch.randn(16, 32, generator=g))
    idx = torch.randint(0, 64, (8, 16), generator=g)
    models["gpt"] = (GPT(), idx, torch.randint(0, 64, (8, 16), generator=g))
    models["unet"] = (UNet(), torch.randn(4, 3, 16, 16, generator=g),
                      torch.randn(4, 2, 16, 16, generator=g))
    models["cnn_bn"] = (CNN(), torch.randn(8, 3, 8, 8, generator=g),
                        torch.randint(0, 10, (8,), generator=g))
    models["multi"] = (Multi(), {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)},
                       torch.randn(8, 8, generator=g))
    models["iface"] = (Iface(), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g))
    models["llama"] = (Llama(), torch.randint(0, 64, (8, 16), generator=g),
                       torch.randint(0, 64, (8, 16), generator=g))
    models["llama_fixed_heads"] = (Llama(fixed_heads=True), torch.randint(0, 64, (8, 16), generator=g),
                                   torch.randint(0, 64, (8, 16), generator=g))
    if gpt_layers:
        models["gpt_deep"] = (GPT(vocab=32, d=16, n_head=2, n_layer=gpt_layers, max_len=8),
                              torch.randint(0, 32, (4, 8), generator=g),
                              torch.randint(0, 32, (4, 8), generator=g))
    return models


def demo_data(out):
    """A learnable task for the demo: predict the next token of repeating sequences."""
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, 64, (64, 1), generator=g)
    steps = torch.randint(1, 4, (64, 1), generator=g)
    seq = (starts + steps * torch.arange(17)) % 64
    torch.save({"inputs": seq[:, :16].contiguous(), "targets": seq[:, 1:].contiguous()}, os.path.join(out, "gpt.demo.data.pt"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--gpt-layers", type=int, default=0, help="also make gpt_deep with N blocks")
    args = ap.parse_args()
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    for name, (model, example, target) in zoo(args.gpt_layers).items():
        if only and name not in only:
            continue
        model.train()
        scripted = torch.jit.script(model)
        scripted.save(os.path.join(args.out, name + ".pt"))
        torch.save(example, os.path.join(args.out, name + ".input.pt"))
        torch.save(target, os.path.join(args.out, name + ".target.pt"))
        # The job data format: {"inputs": forward()'s arguments, "targets": ...}.
        torch.save({"inputs": example, "targets": target}, os.path.join(args.out, name + ".data.pt"))
        if name == "mlp":
            # A plain checkpoint (not TorchScript): an error case for the loader.
            torch.save(model.state_dict(), os.path.join(args.out, "mlp.checkpoint.pt"))
    if not only or "gpt" in only:
        demo_data(args.out)
    print("wrote zoo to", args.out)


if __name__ == "__main__":
    main()
