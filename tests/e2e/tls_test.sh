#!/bin/bash
# TLS end to end: certificates from scripts/make-dev-certs; a real coordinator serving
# gRPC over TLS with mTLS for workers (--tls-client-ca); workers with a client
# certificate register and train a job that pippyctl (--tls-ca) submits and fetches;
# a worker without a client certificate is refused (UNAUTHENTICATED), and so is a
# pippyctl that does not trust the coordinator's CA.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/tls"
rm -rf "$TMP" && mkdir -p "$TMP"
passed=0
failed=0
pids=()
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 0.3
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
}
trap cleanup EXIT

scripts/make-dev-certs "$TMP/certs" > /dev/null || { echo "FAIL make-dev-certs"; exit 1; }
C="$TMP/certs"
"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --tls-cert "$C/server.pem" \
  --tls-key "$C/server.key" --tls-client-ca "$C/ca.pem" > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port")"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" --tls-ca "$C/ca.pem" "$@"; }
for i in 0 1; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --tls-ca "$C/ca.pem" --tls-cert "$C/client.pem" \
    --tls-key "$C/client.key" > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
idle() { ctl workers --output json 2>/dev/null | /usr/bin/python3 -c \
  "import json,sys; print(sum(1 for w in json.load(sys.stdin).get('workers', []) if w['state']=='IDLE'))"; }
for _ in $(seq 150); do [ "$(idle)" = 2 ] && break; sleep 0.1; done
[ "$(idle)" = 2 ] && ok "2 workers with client certificates registered over mTLS" || bad "workers over mTLS: $(idle)"

# A worker without a client certificate: refused, says why, exits.
timeout 30 "$WORKER" --coordinator "$ADDR" --name nocert --tls-ca "$C/ca.pem" > "$TMP/nocert.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && grep -q "client certificate signed by the coordinator's --tls-client-ca" "$TMP/nocert.log" &&
   [ "$(idle)" = 2 ]; then
  ok "a worker without a client certificate is refused (exit $rc): $(tail -1 "$TMP/nocert.log" | cut -c1-160)"
else
  bad "worker without a certificate: exit $rc, $(cat "$TMP/nocert.log")"
fi
# A plaintext pippyctl, and one that does not trust the CA: refused, exit 3.
"$PIPPYCTL" --coordinator "$ADDR" list > "$TMP/plain.out" 2>&1
rc_plain=$?
scripts/make-dev-certs "$TMP/other" > /dev/null
"$PIPPYCTL" --coordinator "$ADDR" --tls-ca "$TMP/other/ca.pem" list > "$TMP/untrusted.out" 2>&1
rc_untrusted=$?
if [ "$rc_plain" = 3 ] && [ "$rc_untrusted" = 3 ]; then
  ok "plaintext and untrusting clients cannot talk to it (exit 3 both)"
else
  bad "plaintext client exit $rc_plain ($(cat "$TMP/plain.out")), untrusting client exit $rc_untrusted"
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
"$PIPPYCTL" health "$ADDR" --tls-ca "$C/ca.pem" > /dev/null && ok "health over TLS" || bad "health over TLS"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
