#!/bin/bash
# deploy/systemd as shipped: every unit passes `systemd-analyze verify` (ExecStart
# pointed at the binaries built here), keeps its hardening directives and the fixed
# pippy user (deploy/sysusers.d), and each unit's own ExecStart line, with only paths,
# specifiers and ports substituted (the credentials from `pippyctl certs init`), starts
# a daemon that says READY=1 under Type=notify: the coordinator secured (TLS, worker
# mTLS, tokens) and pinging the watchdog, CPU worker instances 0 and 12 registered
# over mTLS on their own offset ports, and the GPU unit's worker refusing clearly where
# there is no GPU.
set -u
TMP="${TEST_TMPDIR:-$(mktemp -d)}/systemd"
rm -rf "$TMP" && mkdir -p "$TMP/units"
passed=0
failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
UNITS="$PWD/deploy/systemd"

if ! command -v systemd-analyze > /dev/null; then
  echo "FAIL systemd-analyze is not installed (scripts/setup installs Debian's systemd)"
  exit 1
fi
for unit in "$UNITS"/*.service; do
  name=$(basename "$unit")
  # Instances of a template are what gets verified (pippy-worker@0).
  [[ "$name" == *@.service ]] && name="${name/@./@0.}"
  sed -e "s#/usr/local/bin/pippy-#$PWD/coordinator/pippy-#" "$unit" |
    sed -e "s#$PWD/coordinator/pippy-worker#$PWD/worker/pippy-worker#" > "$TMP/units/$name"
  if out=$(cd "$TMP/units" && timeout 60 systemd-analyze verify "$TMP/units/$name" 2>&1) && [ -z "$out" ]; then
    ok "systemd-analyze verify $(basename "$unit")"
  else
    bad "systemd-analyze verify $(basename "$unit"): $out"
  fi
done
# The units' own directives: notify, watchdog, the fixed user, hardening; no NIC
# hard-coded; the GPU template picks its device by instance.
for unit in "$UNITS"/*.service; do
  for key in "Type=notify" "WatchdogSec=" "User=pippy" "Group=pippy" "ProtectSystem=strict" "PrivateTmp=yes" \
             "NoNewPrivileges=yes" "LoadCredential="; do
    grep -q "^$key" "$unit" || bad "$(basename "$unit") lacks $key"
  done
  grep -q "^DynamicUser=yes" "$unit" && bad "$(basename "$unit") uses DynamicUser (instances would differ in user)"
  grep -q "^Environment=UCX_NET_DEVICES" "$unit" && bad "$(basename "$unit") hard-codes a NIC"
done
grep -q "^u pippy " "$PWD/deploy/sysusers.d/pippy.conf" || bad "deploy/sysusers.d/pippy.conf does not make the pippy user"
grep -q "^StateDirectory=pippy" "$UNITS/pippy-coordinator.service" || bad "the coordinator unit lacks StateDirectory=pippy"
grep -q -- "--device cuda:%i" "$UNITS/pippy-worker-gpu@.service" || bad "the GPU worker unit does not use --device cuda:%i"
grep -q -- "--device cpu" "$UNITS/pippy-worker@.service" || bad "the CPU worker unit does not use --device cpu"
ok "units: notify, watchdog, User=pippy, credentials, hardening; no DynamicUser, no NIC; GPU unit on cuda:%i"

"$PWD/client/pippyctl" certs init "$TMP/pki" > "$TMP/certs.out" || bad "certs init: $(cat "$TMP/certs.out")"
/usr/bin/python3 - "$TMP" "$PWD" <<'PY'
import os, re, shlex, shutil, socket, subprocess, sys, tempfile, time
tmp, root = sys.argv[1:3]
units = f"{root}/deploy/systemd"
host = socket.gethostname()
good = True
def say(ok, what):
    global good
    good &= ok
    print(("ok   " if ok else "FAIL ") + what, flush=True)
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
# The credentials directory systemd would make from LoadCredential=NAME:PATH.
def credentials(unit_text, name):
    d = f"{tmp}/creds-{name}"
    os.makedirs(d, exist_ok=True)
    for cred, path in re.findall(r"^LoadCredential=([^:]+):(\S+)$", unit_text, re.M):
        assert path.startswith("/etc/pippy/pki/"), path
        shutil.copy(f"{tmp}/pki/{os.path.basename(path)}", f"{d}/{cred}")
    return d
# The unit's ExecStart, as systemd would run it for `instance`: specifiers and
# variables expanded, the install paths pointed at this build, ports made free.
def exec_start(unit, instance, ports, env):
    text = open(f"{units}/{unit}").read()
    line = re.search(r"^ExecStart=(.*)$", text, re.M).group(1)
    line = line.replace("%i", str(instance)).replace("%H", host)
    for var, value in env.items():
        line = line.replace("${" + var + "}", value)
    for old, new in ports.items():
        line = re.sub(rf"(--{old} )\d+", rf"\g<1>{new}", line)
    argv = shlex.split(line)
    argv[0] = argv[0].replace("/usr/local/bin/pippy-coordinator", f"{root}/coordinator/pippy-coordinator")
    argv[0] = argv[0].replace("/usr/local/bin/pippy-worker", f"{root}/worker/pippy-worker")
    return text, argv
sockets = tempfile.mkdtemp(prefix="pippy-notify-", dir="/tmp")  # AF_UNIX paths are short
def listen(name):
    path = f"{sockets}/{name}.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(30)
    return s, path
def wait_ready(sock, what, proc):
    got = []
    deadline = time.time() + 30
    while time.time() < deadline and proc.poll() is None:
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        got.append(msg)
        if "READY=1" in msg.split("\n"):
            return msg
    return None
procs = []
try:
    # The coordinator, from its unit.
    port, metrics = free_port(), free_port()
    text = open(f"{units}/pippy-coordinator.service").read()
    creds = credentials(text, "coordinator")
    _, argv = exec_start("pippy-coordinator.service", 0, {"port": port, "metrics-port": metrics},
                         {"CREDENTIALS_DIRECTORY": creds, "STATE_DIRECTORY": f"{tmp}/state"})
    sock, path = listen("coordinator")
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    env.pop("WATCHDOG_PID", None)  # systemd sets it to the service's pid; unset: any pid
    log = open(f"{tmp}/coordinator.log", "w")
    c = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
    procs.append(c)
    msg = wait_ready(sock, "pippy-coordinator", c)
    say(msg is not None, f"pippy-coordinator from its ExecStart says READY=1 ({msg!r})")
    listening = open(f"{tmp}/coordinator.log").read()
    say("listening on 0.0.0.0:" in listening and "over TLS, workers with mTLS, user tokens" in listening,
        "it listens on every address, secured: " + next((l for l in listening.splitlines() if "listening" in l), "?"))
    deadline, pinged = time.time() + 5, False
    sock.settimeout(1)
    while time.time() < deadline and not pinged:
        try:
            pinged = "WATCHDOG=1" in sock.recv(4096).decode()
        except socket.timeout:
            pass
    say(pinged, "the coordinator pings the watchdog (WATCHDOG_USEC=2 s)")
    # CPU worker instances 0 and 12, from the template: their own offset ports.
    health, wmetrics = free_port(), free_port()
    env_file = {"PIPPY_COORDINATOR": f"127.0.0.1:{port}"}
    text = open(f"{units}/pippy-worker@.service").read()
    say(re.search(r"^EnvironmentFile=/etc/pippy/pippy.env$", text, re.M) is not None,
        "the worker units read PIPPY_COORDINATOR from /etc/pippy/pippy.env")
    creds = credentials(text, "worker")
    for instance in (0, 12):
        _, argv = exec_start("pippy-worker@.service", instance, {"health-port": health, "metrics-port": wmetrics},
                             {"CREDENTIALS_DIRECTORY": creds})
        wsock, wpath = listen(f"worker{instance}")
        env = dict(os.environ, NOTIFY_SOCKET=wpath, **env_file)
        log = open(f"{tmp}/worker{instance}.log", "w")
        w = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        procs.append(w)
        msg = wait_ready(wsock, f"pippy-worker@{instance}", w)
        say(msg is not None, f"pippy-worker@{instance} from its ExecStart registered over mTLS: READY=1 ({msg!r})")
        h = subprocess.run([f"{root}/client/pippyctl", "health", f"127.0.0.1:{health + instance}"],
                           capture_output=True, text=True)
        say(h.returncode == 0 and "SERVING" in h.stdout,
            f"pippy-worker@{instance}'s health answers on port base+{instance}: {h.stdout.strip() or h.stderr.strip()}")
    listed = subprocess.run([f"{root}/client/pippyctl", "--coordinator", f"127.0.0.1:{port}", "--tls-ca",
                             f"{tmp}/pki/ca.pem", "--token-file", f"{tmp}/pki/token-admin", "workers"],
                            capture_output=True, text=True)
    say(listed.returncode == 0 and f"{host}-cpu0" in listed.stdout and f"{host}-cpu12" in listed.stdout,
        f"the coordinator lists {host}-cpu0 and {host}-cpu12 (pippyctl with the CA and a token)")
    # The GPU template's worker, where this machine has no GPU: refused, naming the device.
    gpu = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    if not gpu:
        _, argv = exec_start("pippy-worker-gpu@.service", 0, {"health-port": free_port(), "metrics-port": free_port()},
                             {"CREDENTIALS_DIRECTORY": creds})
        r = subprocess.run(argv, env=dict(os.environ, **env_file), capture_output=True, text=True, timeout=60)
        say(r.returncode != 0 and "cuda" in (r.stdout + r.stderr).lower(),
            f"pippy-worker-gpu@0 without a GPU exits {r.returncode}: {(r.stdout + r.stderr).strip().splitlines()[-1][:150]}")
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
if [ $? -eq 0 ]; then ok "each unit's ExecStart runs as shipped"; else bad "the units' ExecStart lines"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
