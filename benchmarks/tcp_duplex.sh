#!/bin/bash
# Plain TCP (Python sockets, no Gloo) over a veth pair shaped as `gradsync --bandwidth` shapes
# it (tbf, 50 ms queue): 8 MB one way, then 8 MB both ways at once over the same connection.
# A ratio near 1 means the emulated link is full duplex, so a slowdown that commbench's
# `exchange` shows on the same link comes from the transport, not the link.
# Needs root (namespaces, tc). Usage: sudo benchmarks/tcp_duplex.sh [RATE]   (default 100mbit)
rate=${1:-100mbit}
set -e
# The token bucket gradsync's --bandwidth sets at this rate (gradsync.netem.tbf_arguments).
tbf=$(python3 -c "import sys; from gradsync.netem import tbf_arguments; from gradsync.predict.network import parse_bandwidth; print(' '.join(tbf_arguments(round(parse_bandwidth(sys.argv[1]) * 8))))" "$rate")
cleanup() { ip netns del dxa 2>/dev/null || true; ip netns del dxb 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add dxa; ip netns add dxb
ip link add dxva type veth peer name dxvb
ip link set dxva netns dxa; ip link set dxvb netns dxb
ip -n dxa addr add 10.77.0.1/24 dev dxva; ip -n dxb addr add 10.77.0.2/24 dev dxvb
ip -n dxa link set dxva up; ip -n dxb link set dxvb up; ip -n dxa link set lo up; ip -n dxb link set lo up
shape() {
  for ns in dxa dxb; do dev=dxv${ns:2:1}; ip netns exec $ns tc qdisc del dev $dev root 2>/dev/null || true
    ip netns exec $ns tc qdisc add dev $dev root handle 1: $tbf
  done; }
run() { # $1 = label
  ip netns exec dxb python3 "$(dirname "$0")/tcp_duplex_peer.py" server 10.77.0.2 &
  sleep 1  # the server listens before the client connects (the client also retries)
  ip netns exec dxa python3 "$(dirname "$0")/tcp_duplex_peer.py" client 10.77.0.2 "$1"
  wait
}
shape; run "plain TCP, $tbf"
