#!/usr/bin/python3
"""Checks exported stages in Python: loads DIR/stage_N.pt with torch.jit.load, chains
them as DIR/plan.json says (values sent to any later stage, model inputs given to
the stages that read them), and compares the result with the original model.

usage: chain_stages.py MODEL.pt EXAMPLE_INPUT.pt DIR
Prints one line per check and exits non-zero on a mismatch.
"""
import json
import sys

import torch


def flatten(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for e in v for t in flatten(e)]
    return []


def as_args(example, model):
    names = [a.name for a in model.forward.schema.arguments[1:]]
    if isinstance(example, dict):
        return [example[n] for n in names]
    if isinstance(example, (tuple, list)) and len(names) != 1:
        return list(example)
    return [example]


def main():
    model_path, input_path, out_dir = sys.argv[1:4]
    torch.manual_seed(0)
    model = torch.jit.load(model_path)
    args = as_args(torch.load(input_path), model)
    plan = json.load(open(f"{out_dir}/plan.json"))
    stages = [torch.jit.load(f"{out_dir}/stage_{s['index']}.pt") for s in plan["stages"]]

    original_names = set(model.state_dict().keys())  # every name, tied weights included
    outputs = {}
    result = None
    with torch.no_grad():
        expected = model(*args)
        for s, stage in zip(plan["stages"], stages):
            names = set(stage.state_dict().keys())
            unknown = names - original_names
            if unknown:
                print(f"FAIL stage {s['index']}: parameters not named as in the model: {sorted(unknown)}")
                return 1
            stage_args = []
            for si in s["inputs"]:
                if "model_input" in si and si.get("source_stage") is None:
                    stage_args.append(args[si["model_input"]])
                else:
                    stage_args.append(outputs[si["source_stage"]][si["source_output"]])
            out = stage(*stage_args)
            if s["is_last"]:
                result = out
            else:
                outputs[s["index"]] = list(out)
    got, want = flatten(result), flatten(expected)
    if len(got) != len(want):
        print(f"FAIL output structure: {len(got)} tensors, expected {len(want)}")
        return 1
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            print(f"FAIL shape {tuple(g.shape)} != {tuple(w.shape)}")
            return 1
        d = (g.double() - w.double()).abs().max().item() / max(w.double().abs().max().item(), 1e-30)
        worst = max(worst, d)
    ok = worst <= 1e-6
    print(f"{'ok  ' if ok else 'FAIL'} {model_path}: {len(stages)} stages chained in Python, "
          f"max relative difference {worst:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
