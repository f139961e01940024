#!/bin/bash
# The README's walk-throughs run as written: the "Train a model" block's `$ ` command
# lines (pippyctl on PATH, the zoo's models in the current folder) and then the Python
# client's snippet, each command expected to succeed. They use the default port 7070
# and ./pippy-state, as a new user would: so the test runs in a network namespace of its
# own (root; where that is impossible scripts/test leaves it out, tagged netns, and says
# so) and in a scratch folder. The only thing added: after a command sent to the
# background, the next waits (up to 30 s) until the 2 workers it starts registered.
set -u
ROOT="$PWD"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/readme"
rm -rf "$TMP" && mkdir -p "$TMP/bin" "$TMP/work"
[ "$(id -u)" = 0 ] || { echo "FAIL readme_test cannot run here: it needs root for a network namespace of its own"; exit 1; }
for b in pippyctl pippyctl-split; do ln -s "$ROOT/client/$b" "$TMP/bin/$b"; done
ln -s "$ROOT/coordinator/pippy-coordinator" "$TMP/bin/pippy-coordinator"
ln -s "$ROOT/worker/pippy-worker" "$TMP/bin/pippy-worker"
cp "$ROOT"/examples/models/zoo/{gpt,mlp}.{pt,data.pt} "$TMP/work/"

# The blocks, as scripts.
/usr/bin/python3 - "$ROOT/README.md" "$TMP" <<'PY'
import re, sys
readme, tmp = sys.argv[1:3]
text = open(readme).read()
def block(heading, fence):
    at = text.index(heading)
    start = text.index(fence, at) + len(fence)
    return text[start:text.index("```", start)]
lines, commands, pending = block("### Train a model", "```\n").splitlines(), [], ""
for line in lines:
    if pending:
        pending += "\n" + line
    elif line.startswith("$ "):
        pending = line[2:]
    else:
        continue  # output shown in the README
    if not pending.rstrip().endswith("\\"):
        commands.append(pending)
        pending = ""
with open(f"{tmp}/train.sh", "w") as out:
    out.write("set -u\n")
    for c in commands:
        c = re.sub(r"[ \t]+#[^\n]*$", "", c)  # the README's comments
        background = c.rstrip().endswith("&")
        out.write(f"echo '$ {c.splitlines()[0]}'\n{c}\n")
        if background:
            out.write(f"echo $! >> {tmp}/background.pids\n")
            out.write("for _ in $(seq 300); do [ \"$(pippyctl workers --output json 2>/dev/null | "
                      "/usr/bin/python3 -c 'import json,sys; print(len(json.load(sys.stdin)[\"workers\"]))' "
                      "2>/dev/null)\" = 2 ] && break; sleep 0.1; done\n")
        else:
            out.write("rc=$?; [ $rc = 0 ] || { echo \"README command failed (exit $rc)\"; exit 1; }\n")
    out.write("echo ALL-RAN\n")
open(f"{tmp}/client.py", "w").write(block("## Python client", "```python\n"))
print(f"{len(commands)} commands from 'Train a model'")
PY
cat > "$TMP/run.sh" <<RUN
set -u
ip link set lo up
export PATH="$TMP/bin:\$PATH" PYTHONPATH="$ROOT/client/python" OPENBLAS_NUM_THREADS=1
cd "$TMP/work"
bash "$TMP/train.sh" > "$TMP/train.out" 2>&1
train=\$?
/usr/bin/python3 "$TMP/client.py" > "$TMP/client.out" 2>&1
client=\$?
for p in \$(cat "$TMP/background.pids" 2>/dev/null); do kill -TERM "\$p"; done; sleep 1
echo "\$train \$client" > "$TMP/rc"
RUN
if ! unshare --net bash "$TMP/run.sh" 2> "$TMP/unshare.err"; then
  echo "FAIL readme_test cannot run here: no network namespace ($(cat "$TMP/unshare.err"))"
  exit 1
fi
read -r train client < "$TMP/rc"
passed=0 failed=0
if [ "$train" = 0 ] && grep -q ALL-RAN "$TMP/train.out" && [ -s "$TMP/work/trained.pt" ] && [ -s "$TMP/work/trace.json" ] &&
   [ -d "$TMP/work/pippy-state" ]; then
  echo "ok   'Train a model' ran as written: $(grep -c '^\$ ' "$TMP/train.out") commands; trained.pt, trace.json and ./pippy-state made"
  passed=$((passed + 1))
else
  echo "FAIL 'Train a model' (exit $train):"; tail -15 "$TMP/train.out"
  failed=$((failed + 1))
fi
if [ "$client" = 0 ]; then
  echo "ok   the Python client's snippet ran as written: $(tail -1 "$TMP/client.out" | cut -c1-100)"
  passed=$((passed + 1))
else
  echo "FAIL the Python client's snippet (exit $client):"; tail -15 "$TMP/client.out"
  failed=$((failed + 1))
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
