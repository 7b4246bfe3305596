#!/usr/bin/env bash
# Quick start: installs what building kvside needs (configs/install-deps.sh
# without --tests: compiler, meson, ninja and the libraries; Debian 12 or 13),
# builds it, starts kvside-server with its embedded defaults plus an L2
# directory, runs a short 4-rank demo against it, restarts the server and
# shows the same prompt hitting from L2 and retrieving byte-exact.
set -euo pipefail
cd "$(dirname "$0")"
./configs/install-deps.sh
[ -d build ] || meson setup build >/dev/null
ninja -C build >/dev/null
l2=$(mktemp -d /tmp/kvside-demo-l2.XXXXXX)
srv=
stop() { [ -n "$srv" ] && kill "$srv" 2>/dev/null && wait "$srv" 2>/dev/null || true; srv=; }
trap 'stop; rm -rf "$l2"' EXIT
start() {
  ./build/server/kvside-server --l2-path "$l2" --l2-size 1G --log-level warn &
  srv=$!
  sleep 0.5
}
echo "== starting kvside-server (defaults, L2 in $l2)"
start
./build/worker/kvside-demo
echo "== restarting kvside-server (SIGTERM flushes queued L2 writes; kill -9 keeps every finished group commit)"
stop
start
./build/worker/kvside-demo --after-restart
