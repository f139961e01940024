#!/bin/bash
# Three "hosts" on one machine: the coordinator and two workers each in a network
# namespace of their own, joined by veth pairs to a bridge (10.77.x.0/24), so that
# 127.0.0.1 in one is not the others' and nothing reaches a peer but through the
# network. The coordinator is started as the README shows: unsecured, another address
# than loopback is refused; with pippyctl certs init's files (TLS, worker mTLS, user
# tokens) it listens on every address, a worker from another namespace without a
# client certificate is refused and the certified ones are accepted. UCX runs over tcp
# (UCX_NET_DEVICES = the worker's veth), gRPC to the coordinator's bridge address. A
# 2-stage 1F1B job of the zoo's MLP trains to completion and the fetched model is
# checked against the unsplit model trained by /usr/bin/python3. Also: a worker whose
# namespace cannot route to the coordinator fails with a clear error.
#
# Needs root (network namespaces, veth). Where it cannot run, scripts/test leaves it
# out (--test_tag_filters=-netns) and prints it as SKIPPED with the reason; run here
# anyway, it fails saying why rather than passing without testing.
set -u
cannot() {
  echo "FAIL netns_test cannot run here: $1 (scripts/test leaves it out where it cannot run, and says so)"
  exit 1
}
[ "$(id -u)" = 0 ] || cannot "it needs root to create network namespaces and veth pairs"
command -v ip > /dev/null || cannot "it needs iproute2's ip (scripts/setup installs it)"
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/netns"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

# Names unique to this run; a subnet from the pid so that parallel runs do not meet.
tag="pp$$"
net="10.77.$(( $$ % 250 + 1 ))"
NS_C="$tag-c" NS_W0="$tag-w0" NS_W1="$tag-w1" NS_LOST="$tag-lost"
cleanup() {
  stop_started
  for ns in "$NS_C" "$NS_W0" "$NS_W1" "$NS_LOST"; do ip netns del "$ns" 2> /dev/null; done
}
trap cleanup EXIT
ip netns add "$NS_C" 2> "$TMP/netns.err" ||
  cannot "no network namespace ($(cat "$TMP/netns.err")); it needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
setup() {
  set -e
  ip -n "$NS_C" link set lo up
  ip -n "$NS_C" link add br0 type bridge
  ip -n "$NS_C" addr add "$net.1/24" dev br0
  ip -n "$NS_C" link set br0 up
  local i=0
  for ns in "$NS_W0" "$NS_W1" "$NS_LOST"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "v$tag$i" netns "$ns" type veth peer name "p$tag$i" netns "$NS_C"
    ip -n "$ns" link set "v$tag$i" up
    ip -n "$NS_C" link set "p$tag$i" master br0
    ip -n "$NS_C" link set "p$tag$i" up
    i=$((i + 1))
  done
  ip -n "$NS_W0" addr add "$net.10/24" dev "v${tag}0"
  ip -n "$NS_W1" addr add "$net.11/24" dev "v${tag}1"
  # The lost worker's link is up but on another subnet: no route to the coordinator.
  ip -n "$NS_LOST" addr add "10.78.0.12/24" dev "v${tag}2"
  set +e
}
(setup) > "$TMP/setup.log" 2>&1 || cannot "setting up veth pairs and a bridge failed: $(tail -3 "$TMP/setup.log")"
ok "3 network namespaces joined by veth pairs to a bridge ($net.0/24)"
ip -n "$NS_W0" route get "$net.11" 2>/dev/null | grep -q "dev v${tag}0" &&
  ok "worker 0's namespace routes worker 1's address over its veth" || bad "no route between the workers' namespaces"
ip netns exec "$NS_W0" ip -4 addr show | grep -q "$net.11" && bad "a worker namespace has the other's address" ||
  ok "each namespace has only its own addresses"

# Unsecured, the coordinator will not listen on the bridge address.
ip netns exec "$NS_C" "$COORD" --bind "$net.1" --port 0 --state-dir "$TMP/state0" > "$TMP/open.out" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q "listening beyond loopback needs TLS" "$TMP/open.out" &&
  ok "unsecured, --bind $net.1 is refused (exit 2)" || bad "unsecured --bind $net.1: exit $rc, $(cat "$TMP/open.out")"
# As the README starts it: pippyctl certs init's files, no --bind (every address).
PKI="$TMP/pki"
"$PIPPYCTL" certs init "$PKI" --name "$net.1" > "$TMP/certs.out" || bad "certs init: $(cat "$TMP/certs.out")"
ip netns exec "$NS_C" "$COORD" --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --tls-cert "$PKI/server.pem" \
  --tls-key "$PKI/server.key" --tls-client-ca "$PKI/ca.pem" --auth-token-file "$PKI/tokens" > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="$net.1:$(cat "$TMP/port")"
ctl() { ip netns exec "$NS_C" "$PIPPYCTL" --coordinator "$ADDR" --tls-ca "$PKI/ca.pem" --token-file "$PKI/token-admin" "$@"; }
# From a worker's namespace the coordinator is only at the bridge address.
timeout 30 ip netns exec "$NS_W0" "$PIPPYCTL" --coordinator "127.0.0.1:$(cat "$TMP/port")" --tls-ca "$PKI/ca.pem" \
  --token-file "$PKI/token-admin" list > "$TMP/lo.out" 2>&1 &&
  bad "a worker namespace reached the coordinator at 127.0.0.1" || ok "127.0.0.1 in a worker's namespace is not the coordinator's"
# From another address: a worker without a client certificate, and a plaintext one, are refused.
timeout 30 ip netns exec "$NS_W1" "$WORKER" --coordinator "$ADDR" --name nocert --tls-ca "$PKI/ca.pem" \
  --reconnect-timeout-s 0 > "$TMP/nocert.log" 2>&1
rc_nocert=$?
timeout 30 ip netns exec "$NS_W1" "$WORKER" --coordinator "$ADDR" --name plain --reconnect-timeout-s 0 > "$TMP/plain.log" 2>&1
rc_plain=$?
if [ "$rc_nocert" != 0 ] && [ "$rc_nocert" != 124 ] && grep -q "client certificate" "$TMP/nocert.log" &&
   [ "$rc_plain" != 0 ] && [ "$rc_plain" != 124 ] && ! ctl workers --output json | grep -q '"nocert"\|"plain"'; then
  ok "from $net.11, workers without a client certificate are refused: $(tail -1 "$TMP/nocert.log" | cut -c1-120); plaintext exit $rc_plain"
else
  bad "unauthenticated workers: exit $rc_nocert ($(tail -2 "$TMP/nocert.log")), plaintext exit $rc_plain ($(tail -1 "$TMP/plain.log"))"
fi
i=0
for ns in "$NS_W0" "$NS_W1"; do
  ip netns exec "$ns" env UCX_NET_DEVICES="v$tag$i" UCX_TLS=tcp,self "$WORKER" --coordinator "$ADDR" --name "w$i" \
    --ucx-tls tcp,self --wait-timeout-s 30 --tls-ca "$PKI/ca.pem" --tls-cert "$PKI/worker.pem" \
    --tls-key "$PKI/worker.key" > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
for _ in $(seq 200); do [ "$(idle_workers)" = 2 ] && break; sleep 0.1; done
[ "$(idle_workers)" = 2 ] && ok "2 certified workers registered from their own namespaces over mTLS" || bad "workers registered: $(idle_workers)"

rx_bytes() { ip -n "$NS_W1" -s link show "v${tag}1" | awk '/RX:/{getline; print $1; exit}'; }
rx_before=$(rx_bytes)
ARGS=(--stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 --steps 4 --loss mse --optimizer sgd --momentum 0.9 --lr 0.05)
if ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${ARGS[@]}" --wait > "$TMP/job.out" 2> "$TMP/job.err"; then
  job=$(head -1 "$TMP/job.out")
  ok "a 2-stage 1F1B job trained across the namespaces over UCX tcp ($job)"
  if ctl fetch "$job" -o "$TMP/trained.pt" > /dev/null &&
     diff=$(/usr/bin/python3 "$CHECK" "$ZOO/mlp.pt" "$ZOO/mlp.data.pt" "$TMP/trained.pt" --steps 4 --batch-size 16 \
              --microbatches 4 --loss mse --optimizer sgd --momentum 0.9 --lr 0.05 --tolerance 1e-5); then
    ok "equals the unsplit model trained in one process: $diff"
  else
    bad "trained model differs from the reference: $diff"
  fi
else
  bad "job across namespaces: $(tail -3 "$TMP/job.err"); w0: $(tail -3 "$TMP/w0.log")"
fi
# Its stage, the activations and the gradients reached worker 1 through its veth.
rx=$(( $(rx_bytes) - rx_before ))
[ "$rx" -gt 10000 ] && ok "worker 1's veth received $rx bytes during the job" || bad "worker 1's veth received only $rx bytes"

# A worker whose namespace has no route to the coordinator: exits with a clear error.
timeout 60 ip netns exec "$NS_LOST" "$WORKER" --coordinator "$ADDR" --name lost --reconnect-timeout-s 2 --tls-ca "$PKI/ca.pem" \
  > "$TMP/lost.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -qi "coordinator" "$TMP/lost.log"; then
  ok "an unroutable worker exits $rc: $(tail -1 "$TMP/lost.log" | cut -c1-140)"
else
  bad "unroutable worker: exit $rc, $(tail -3 "$TMP/lost.log")"
fi
finish
