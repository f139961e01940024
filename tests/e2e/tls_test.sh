#!/bin/bash
# TLS and user tokens end to end: certificates and tokens from pippyctl certs init; a real
# coordinator started as the README shows (TLS, mTLS for workers, user tokens: it then
# listens on every address); without them it listens on loopback only and refuses
# another --bind unless --insecure, which pippyctl health reports. Workers with a client
# certificate register and train a job that pippyctl (--tls-ca) submits and fetches;
# a worker without a client certificate is refused (UNAUTHENTICATED), one whose
# certificate another CA signed is refused at the handshake (and says which flags to
# check), and so is a pippyctl that does not trust the coordinator's CA.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/tls"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

"$PIPPYCTL" certs init "$TMP/certs" > "$TMP/certs.out" || { echo "FAIL pippyctl certs init: $(cat "$TMP/certs.out")"; exit 1; }
C="$TMP/certs"
# Secure by default: without TLS, mTLS and tokens, another address than loopback is refused.
"$COORD" --bind 0.0.0.0 --port 0 --state-dir "$TMP/state0" > "$TMP/open.out" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q "listening beyond loopback needs TLS.*--tls-client-ca.*--auth-token-file.*--insecure" "$TMP/open.out"; then
  ok "--bind 0.0.0.0 without TLS, mTLS and tokens is refused (exit 2): $(cut -c1-120 "$TMP/open.out")"
else
  bad "--bind 0.0.0.0 unsecured: exit $rc, $(cat "$TMP/open.out")"
fi
# The coordinator as the README starts it: the three files, no --bind.
"$COORD" --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --tls-cert "$C/server.pem" \
  --tls-key "$C/server.key" --tls-client-ca "$C/ca.pem" --auth-token-file "$C/tokens" > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
[ -s "$TMP/port" ] || { echo "FAIL the secured coordinator did not start: $(cat "$TMP/coordinator.log")"; finish; }
grep -q "listening on 0.0.0.0:.* over TLS, workers with mTLS, user tokens" "$TMP/coordinator.log" &&
  ok "secured (TLS, worker mTLS, tokens), it listens on every address" || bad "secured start: $(head -3 "$TMP/coordinator.log")"
ADDR="127.0.0.1:$(cat "$TMP/port")"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" --tls-ca "$C/ca.pem" --token-file "$C/token-admin" "$@"; }
for i in 0 1; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --tls-ca "$C/ca.pem" --tls-cert "$C/worker.pem" \
    --tls-key "$C/worker.key" > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
wait_idle 2 && ok "2 workers with client certificates registered over mTLS" || bad "workers over mTLS: $(idle_workers)"

# A worker without a client certificate: refused, says why, exits.
timeout 30 "$WORKER" --coordinator "$ADDR" --name nocert --tls-ca "$C/ca.pem" > "$TMP/nocert.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && grep -q "client certificate signed by the coordinator's --tls-client-ca" "$TMP/nocert.log" &&
   [ "$(idle_workers)" = 2 ]; then
  ok "a worker without a client certificate is refused (exit $rc): $(tail -1 "$TMP/nocert.log" | cut -c1-160)"
else
  bad "worker without a certificate: exit $rc, $(cat "$TMP/nocert.log")"
fi
# A plaintext pippyctl, and one that does not trust the CA: refused, exit 3.
"$PIPPYCTL" --coordinator "$ADDR" list > "$TMP/plain.out" 2>&1
rc_plain=$?
"$PIPPYCTL" certs init "$TMP/other" > /dev/null
"$PIPPYCTL" --coordinator "$ADDR" --tls-ca "$TMP/other/ca.pem" list > "$TMP/untrusted.out" 2>&1
rc_untrusted=$?
if [ "$rc_plain" = 3 ] && [ "$rc_untrusted" = 3 ]; then
  ok "plaintext and untrusting clients cannot talk to it (exit 3 both)"
else
  bad "plaintext client exit $rc_plain ($(cat "$TMP/plain.out")), untrusting client exit $rc_untrusted"
fi
# A worker whose client certificate another CA signed: refused at the handshake, exits.
timeout 30 "$WORKER" --coordinator "$ADDR" --name wrongcert --tls-ca "$C/ca.pem" --tls-cert "$TMP/other/worker.pem" \
  --tls-key "$TMP/other/worker.key" --reconnect-timeout-s 0 > "$TMP/wrongcert.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(idle_workers)" = 2 ] && grep -q "tls-client-ca signed --tls-cert" "$TMP/wrongcert.log" &&
   ! ctl workers --output json 2>/dev/null | grep -q wrongcert; then
  ok "a worker with a client certificate from another CA is refused (exit $rc): $(tail -1 "$TMP/wrongcert.log" | cut -c1-140)"
else
  bad "worker with another CA's certificate: exit $rc, $(tail -3 "$TMP/wrongcert.log")"
fi
# A job end to end over TLS, fetched and loaded.
if ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 2 --schedule 1f1b --microbatches 4 \
     --batch-size 16 --steps 3 --loss mse --optimizer sgd --wait > "$TMP/job.out" 2> "$TMP/job.err" &&
   job=$(head -1 "$TMP/job.out") && [ -n "$job" ] && ctl fetch "$job" -o "$TMP/trained.pt" > /dev/null &&
   /usr/bin/python3 -c "import sys, torch; torch.jit.load(sys.argv[1])" "$TMP/trained.pt"; then
  ok "a job trained and fetched over TLS ($job)"
else
  bad "job over TLS: $(cat "$TMP/job.err")"
fi
"$PIPPYCTL" health "$ADDR" --tls-ca "$C/ca.pem" > "$TMP/health.out" && ! grep -q warning "$TMP/health.out" &&
  ok "health over TLS, no warning" || bad "health over TLS: $(cat "$TMP/health.out")"
# Certificate rotation: --renew issues new certificates from the same CA; a worker
# with the new one registers with the running coordinator (which trusts the CA).
cp "$C/worker.pem" "$TMP/worker-before.pem"
"$PIPPYCTL" certs init "$C" --renew > "$TMP/renew.out" 2>&1
rc=$?
"$WORKER" --coordinator "$ADDR" --name renewed --ucx-tls sm,self --tls-ca "$C/ca.pem" --tls-cert "$C/worker.pem" \
  --tls-key "$C/worker.key" > "$TMP/renewed.log" 2>&1 &
pids+=($!)
if [ "$rc" = 0 ] && ! cmp -s "$C/worker.pem" "$TMP/worker-before.pem" && wait_idle 3; then
  ok "a worker with a renewed certificate registers with the running coordinator"
else
  bad "renewed certificate: certs init --renew exit $rc ($(tail -1 "$TMP/renew.out")); $(tail -2 "$TMP/renewed.log")"
fi

# Without the three, loopback only (and it says so); --insecure listens beyond it,
# warns at start, and pippyctl health says so.
"$COORD" --port 0 --port-file "$TMP/port3" --state-dir "$TMP/state3" > "$TMP/coordinator3.log" 2>&1 &
pids+=($!)
"$COORD" --bind 0.0.0.0 --insecure --port 0 --port-file "$TMP/port4" --state-dir "$TMP/state4" > "$TMP/coordinator4.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port3" ] && [ -s "$TMP/port4" ] && break; sleep 0.1; done
"$PIPPYCTL" health "127.0.0.1:$(cat "$TMP/port3")" > "$TMP/health3.out" 2>&1
"$PIPPYCTL" health "127.0.0.1:$(cat "$TMP/port4")" > "$TMP/health4.out" 2>&1
if grep -q "listening on 127.0.0.1:" "$TMP/coordinator3.log" && grep -q "loopback only" "$TMP/coordinator3.log" &&
   ! grep -q warning "$TMP/health3.out"; then
  ok "unsecured by default: loopback only, and it says so"
else
  bad "default coordinator: $(head -3 "$TMP/coordinator3.log"); health: $(cat "$TMP/health3.out")"
fi
if grep -q "W coordinator INSECURE: listening on 0.0.0.0" "$TMP/coordinator4.log" &&
   grep -q "^warning: INSECURE: listening on 0.0.0.0 without TLS" "$TMP/health4.out"; then
  ok "--insecure: warned at start and by pippyctl health: $(grep warning "$TMP/health4.out" | cut -c1-100)"
else
  bad "--insecure: $(head -3 "$TMP/coordinator4.log"); health: $(cat "$TMP/health4.out")"
fi

# User tokens (--auth-token-file): no token or a wrong one is UNAUTHENTICATED (exit 2),
# the job records its submitter, and only they may cancel it (PERMISSION_DENIED);
# the coordinator's log never holds a token. (No workers: the jobs wait, queued.)
printf '# users\nalice %s\nbob %s\n' "alice-token-0123456789abcdef" "bob-token-0123456789abcdef" > "$TMP/tokens"
echo "bob-token-0123456789abcdef" > "$TMP/bob.token"
"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port2" --state-dir "$TMP/state2" --auth-token-file "$TMP/tokens" \
  --max-model-mib 1 --max-queued-jobs-per-user 1 > "$TMP/coordinator2.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port2" ] && break; sleep 0.1; done
ADDR2="127.0.0.1:$(cat "$TMP/port2")"
"$PIPPYCTL" --coordinator "$ADDR2" list > "$TMP/anon.out" 2>&1
rc_anon=$?
PIPPY_TOKEN=not-a-known-token-at-all "$PIPPYCTL" --coordinator "$ADDR2" list > "$TMP/wrong.out" 2>&1
rc_wrong=$?
if [ "$rc_anon" != 0 ] && grep -q "UNAUTHENTICATED\|no token" "$TMP/anon.out" && [ "$rc_wrong" != 0 ] &&
   grep -q "unknown token" "$TMP/wrong.out"; then
  ok "no token / a wrong token: refused ($(tail -1 "$TMP/anon.out" | cut -c1-100))"
else
  bad "tokens: anonymous exit $rc_anon ($(cat "$TMP/anon.out")), wrong exit $rc_wrong ($(cat "$TMP/wrong.out"))"
fi
job=$("$PIPPYCTL" --coordinator "$ADDR2" --token-file "$TMP/bob.token" submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" \
        --stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 --steps 3 --loss mse --optimizer sgd 2> "$TMP/bob.err")
owner=$("$PIPPYCTL" --coordinator "$ADDR2" --token-file "$TMP/bob.token" status "$job" --output json |
        /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin).get('user'))")
# Limits: bob's second waiting job, and a 2 MB model over --max-model-mib 1.
"$PIPPYCTL" --coordinator "$ADDR2" --token-file "$TMP/bob.token" submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" \
  --stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 --steps 3 --loss mse --optimizer sgd > "$TMP/second.out" 2>&1
rc_second=$?
/usr/bin/python3 -c "import torch; torch.manual_seed(0); torch.jit.script(torch.nn.Sequential(torch.nn.Linear(800, 800))).save('$TMP/big.pt')"
PIPPY_TOKEN=alice-token-0123456789abcdef "$PIPPYCTL" --coordinator "$ADDR2" submit "$TMP/big.pt" --synthetic \
  "inputs=float32[16,800];targets=float32[16,800]" --stages 1 --schedule 1f1b --microbatches 4 --batch-size 16 \
  --loss mse --optimizer sgd > "$TMP/big.out" 2>&1
rc_big=$?
if [ "$rc_second" != 0 ] && grep -q "bob has 1 jobs waiting.*--max-queued-jobs-per-user" "$TMP/second.out" &&
   [ "$rc_big" != 0 ] && grep -q "model: larger than the coordinator's limit of 1 MiB (--max-model-mib raises it)" "$TMP/big.out"; then
  ok "limits: $(tail -1 "$TMP/second.out" | cut -c1-90); $(tail -1 "$TMP/big.out" | cut -c1-90)"
else
  bad "limits: second job exit $rc_second ($(cat "$TMP/second.out")), big model exit $rc_big ($(cat "$TMP/big.out"))"
fi
PIPPY_TOKEN=alice-token-0123456789abcdef "$PIPPYCTL" --coordinator "$ADDR2" cancel "$job" > "$TMP/alice.out" 2>&1
rc_alice=$?
"$PIPPYCTL" --coordinator "$ADDR2" --token-file "$TMP/bob.token" cancel "$job" > "$TMP/bobcancel.out" 2>&1
rc_bob=$?
if [ "$owner" = bob ] && [ "$rc_alice" != 0 ] && grep -q "submitted by bob; only they can cancel it" "$TMP/alice.out" &&
   [ "$rc_bob" = 0 ]; then
  ok "the job records bob; alice cannot cancel it ($(tail -1 "$TMP/alice.out" | cut -c1-90)), bob can"
else
  bad "owner '$owner', alice exit $rc_alice ($(cat "$TMP/alice.out")), bob exit $rc_bob ($(cat "$TMP/bobcancel.out"))"
fi
grep -q "token-0123456789abcdef\|not-a-known-token" "$TMP/coordinator2.log" && bad "the log holds a token" ||
  ok "the coordinator's log names refused peers but holds no token"

finish
