#!/bin/bash
# Splits every zoo model with `pippyctl split --out` into 2, 3 and 4 stages, then
# loads the stage files in Python (/usr/bin/python3, torch.jit.load), chains them as
# plan.json says and compares with the original model's output.
set -u
PIPPYCTL=client/pippyctl
ZOO=examples/models/zoo
OUT="${TEST_TMPDIR:-/tmp}/exported"
passed=0
failed=0
for model in mlp gpt unet cnn_bn multi mlp_marked; do
  for k in 2 3 4; do
    dir="$OUT/${model}_k$k"
    if [ "$model" = mlp_marked ]; then args=(); else args=(--stages "$k"); fi
    if ! "$PIPPYCTL" split "$ZOO/$model.pt" "${args[@]}" --out "$dir" >/dev/null; then
      echo "FAIL split $model k=$k"; failed=$((failed + 1)); continue
    fi
    if /usr/bin/python3 tests/python/chain_stages.py "$ZOO/$model.pt" "$ZOO/$model.input.pt" "$dir"; then
      passed=$((passed + 1))
    else
      failed=$((failed + 1))
    fi
    [ "$model" = mlp_marked ] && break
  done
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
