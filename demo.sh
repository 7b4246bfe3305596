#!/usr/bin/env bash
# Quick start: installs the build dependencies (Debian 12), builds kvside,
# starts kvside-server with its embedded defaults, runs a short demo workload
# against it, and stops the server.
set -euo pipefail
cd "$(dirname "$0")"
./configs/install-deps.sh
[ -d build ] || meson setup build >/dev/null
ninja -C build >/dev/null
./build/server/kvside-server --log-level info &
srv=$!
trap 'kill $srv 2>/dev/null; wait $srv 2>/dev/null || true' EXIT
sleep 0.5
./build/worker/kvside-demo
