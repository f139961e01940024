#!/bin/bash
# deploy/systemd: every unit passes `systemd-analyze verify` (with ExecStart pointed at
# the binaries built here), and the daemons, started the way the units start them
# (with NOTIFY_SOCKET set by the test, as systemd would for Type=notify), say READY=1:
# the coordinator once it serves, a worker once it registered.
set -u
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
UNITS="$PWD/deploy/systemd"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/systemd"
rm -rf "$TMP" && mkdir -p "$TMP/units"
passed=0
failed=0
pids=()
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; }
trap cleanup EXIT

if ! command -v systemd-analyze > /dev/null; then
  echo "FAIL systemd-analyze is not installed (scripts/setup installs Debian's systemd)"
  exit 1
fi
for unit in "$UNITS"/*.service; do
  name=$(basename "$unit")
  # Instances of a template are what gets verified (pippy-worker@0).
  [[ "$name" == *@.service ]] && name="${name/@./@0.}"
  sed -e "s#/usr/local/bin/pippy-coordinator#$COORD#" -e "s#/usr/local/bin/pippy-worker#$WORKER#" "$unit" \
    > "$TMP/units/$name"
  if out=$(cd "$TMP/units" && timeout 60 systemd-analyze verify "$TMP/units/$name" 2>&1) && [ -z "$out" ]; then
    ok "systemd-analyze verify $(basename "$unit")"
  else
    bad "systemd-analyze verify $(basename "$unit"): $out"
  fi
done
# The units' own directives: notify, watchdog, hardening.
for key in "Type=notify" "WatchdogSec=" "DynamicUser=yes" "ProtectSystem=strict" "PrivateTmp=yes" "NoNewPrivileges=yes"; do
  for unit in "$UNITS"/*.service; do
    grep -q "^$key" "$unit" || bad "$(basename "$unit") lacks $key"
  done
done
grep -q "^StateDirectory=pippy" "$UNITS/pippy-coordinator.service" || bad "the coordinator unit lacks StateDirectory=pippy"
grep -q "^Environment=CUDA_VISIBLE_DEVICES=%i" "$UNITS/pippy-worker@.service" || bad "the worker unit lacks CUDA_VISIBLE_DEVICES=%i"

# READY=1 over NOTIFY_SOCKET, from the ExecStart lines (ports made free for the test).
/usr/bin/python3 - "$TMP" "$COORD" "$WORKER" <<'PY'
import os, shutil, socket, subprocess, sys, tempfile, time
tmp, coord, worker = sys.argv[1:4]
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
sockets = tempfile.mkdtemp(prefix="pippy-notify-", dir="/tmp")  # AF_UNIX paths are short
def listen(name):
    path = f"{sockets}/{name}.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(30)
    return s, path
def wait_ready(sock, what):
    got = []
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        got.append(msg)
        if "READY=1" in msg.split("\n"):
            print(f"ok   {what} said: {msg!r}")
            return True
    print(f"FAIL {what}: no READY=1 in {got}")
    return False
procs, good = [], True
try:
    port, metrics = free_port(), free_port()
    sock, path = listen("coordinator")
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    env.pop("WATCHDOG_PID", None)  # systemd sets it to the service's pid; unset: any pid
    procs.append(subprocess.Popen([coord, "--bind", "127.0.0.1", "--port", str(port), "--state-dir", f"{tmp}/state",
                                   "--heartbeat-timeout-s", "10", "--metrics-port", str(metrics)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/coordinator.log", "w")))
    good &= wait_ready(sock, "pippy-coordinator")
    # The watchdog: pings within the interval.
    deadline = time.time() + 5
    pinged = False
    sock.settimeout(1)
    while time.time() < deadline and not pinged:
        try:
            pinged = "WATCHDOG=1" in sock.recv(4096).decode()
        except socket.timeout:
            pass
    print(("ok   " if pinged else "FAIL ") + "the coordinator pings the watchdog (WATCHDOG_USEC=2 s)")
    good &= pinged
    wsock, wpath = listen("worker")
    env = dict(os.environ, NOTIFY_SOCKET=wpath, PIPPY_COORDINATOR=f"127.0.0.1:{port}", CUDA_VISIBLE_DEVICES="0")
    procs.append(subprocess.Popen([worker, "--device", "cpu", "--name", "unit-0", "--threads", "1",
                                   "--health-port", str(free_port()), "--metrics-port", str(free_port())], env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/worker.log", "w")))
    good &= wait_ready(wsock, "pippy-worker")
finally:
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    shutil.rmtree(sockets, ignore_errors=True)
sys.exit(0 if good else 1)
PY
if [ $? -eq 0 ]; then ok "the daemons say READY=1 (and ping the watchdog) under Type=notify"; else bad "READY=1"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
