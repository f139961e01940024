#!/usr/bin/python3
"""A decoder LM scripted for generation in the gpt-fast style (run with /usr/bin/python3).

The generation contract (docs/api.md#generation):

  forward(idx: Long[B, L], input_pos: Long[B, L], slots: Long[B]) -> Float[B, L, vocab]

Every attention layer keeps its key/value cache as buffers of shape
[max_slots, heads, max_seq, head_dim]. A call writes the new keys and values of row b at
(slots[b], :, input_pos[b, l]) and row b's queries attend to the positions <= input_pos[b, l]
of slot slots[b] only, so rows of a batch never see each other and what a slot held before
(positions past the row's) is masked. A prefill is L = the prompt's length (or a chunk of
it), a decode step L = 1.

  gen_lm.py save --out DIR [--layers N --width D --heads H --vocab V --max-slots S --max-seq N]
      writes DIR/gen_lm.pt (torch.jit.script(model).save) and DIR/gen_lm.input.pt (an example
      (idx, input_pos, slots) for the split)
  gen_lm.py reference MODEL --prompts P.pt --out R.pt [--no-cache]
      greedy generation of each prompt one sequence at a time with the cache (or, with
      --no-cache, by recomputing the whole sequence with a fresh model at every step and
      taking the argmax of its last logits); P.pt is a list of (prompt tokens, new tokens)
"""
import argparse
import math
import os
import sys
from typing import List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class CachedAttention(nn.Module):
    def __init__(self, d: int, n_head: int, max_slots: int, max_seq: int):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d // n_head
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.register_buffer("k_cache", torch.zeros(max_slots, n_head, max_seq, self.head_dim))
        self.register_buffer("v_cache", torch.zeros(max_slots, n_head, max_seq, self.head_dim))

    def forward(self, x, input_pos, slots):
        B, L, C = x.size()
        q = self.q(x).view(B, L, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, L, self.n_head, self.head_dim)
        v = self.v(x).view(B, L, self.n_head, self.head_dim)
        rows = slots.unsqueeze(1).expand(B, L)
        # Index [B, L] (slots) and [B, L] (positions) around a slice: the value is [B, L, H, hd].
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        keys = self.k_cache[slots]      # [B, H, N, hd]
        values = self.v_cache[slots]
        att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, H, L, N]
        n = self.k_cache.size(2)
        seen = torch.arange(n, device=x.device).view(1, 1, n) <= input_pos.unsqueeze(2)  # [B, L, N]
        att = att.masked_fill(~seen.unsqueeze(1), float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ values).transpose(1, 2).contiguous().view(B, L, C)
        return self.o(y)


class GenBlock(nn.Module):
    def __init__(self, d: int, n_head: int, max_slots: int, max_seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CachedAttention(d, n_head, max_slots, max_seq)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, input_pos, slots):
        x = x + self.attn(self.ln1(x), input_pos, slots)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x


class GenLM(nn.Module):
    def __init__(self, vocab=96, d=64, n_head=4, n_layer=4, max_slots=8, max_seq=128):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList([GenBlock(d, n_head, max_slots, max_seq) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, input_pos, slots):
        x = self.tok_emb(idx) + self.pos_emb(input_pos)
        for block in self.blocks:
            x = block(x, input_pos, slots)
        return self.head(self.ln_f(x))


def example_input(max_slots: int):
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pos = torch.arange(4).repeat(2, 1)
    slots = torch.tensor([0, min(1, max_slots - 1)])
    return (idx, pos, slots)


@torch.no_grad()
def greedy_cached(model, prompt: List[int], new_tokens: int, slot: int = 0) -> List[int]:
    """One sequence at a time: a prefill of the whole prompt, then L = 1 steps."""
    idx = torch.tensor([prompt])
    pos = torch.arange(len(prompt)).unsqueeze(0)
    logits = model(idx, pos, torch.tensor([slot]))
    out = []
    nxt = int(logits[0, -1].argmax())
    for i in range(new_tokens):
        out.append(nxt)
        if i + 1 == new_tokens:
            break
        p = len(prompt) + i
        logits = model(torch.tensor([[nxt]]), torch.tensor([[p]]), torch.tensor([slot]))
        nxt = int(logits[0, -1].argmax())
    return out


@torch.no_grad()
def greedy_recompute(path: str, prompt: List[int], new_tokens: int) -> List[int]:
    """No cache carried over: the whole sequence through a fresh model at every step."""
    model = torch.jit.load(path)
    model.eval()
    seq = list(prompt)
    out = []
    for _ in range(new_tokens):
        idx = torch.tensor([seq])
        logits = model(idx, torch.arange(len(seq)).unsqueeze(0), torch.tensor([0]))
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="gen_lm")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--width", type=int, default=64)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--vocab", type=int, default=96)
    s.add_argument("--max-slots", type=int, default=8)
    s.add_argument("--max-seq", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("reference")
    r.add_argument("model")
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--no-cache", action="store_true")
    a = ap.parse_args()
    if a.cmd == "save":
        torch.manual_seed(a.seed)
        m = GenLM(a.vocab, a.width, a.heads, a.layers, a.max_slots, a.max_seq).eval()
        os.makedirs(a.out, exist_ok=True)
        torch.jit.script(m).save(os.path.join(a.out, a.name + ".pt"))
        torch.save(example_input(a.max_slots), os.path.join(a.out, a.name + ".input.pt"))
        return 0
    prompts = torch.load(a.prompts)
    results = []
    if a.no_cache:
        for prompt, n in prompts:
            results.append(greedy_recompute(a.model, list(prompt), int(n)))
    else:
        model = torch.jit.load(a.model)
        model.eval()
        for prompt, n in prompts:
            results.append(greedy_cached(model, list(prompt), int(n)))
    torch.save(results, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
