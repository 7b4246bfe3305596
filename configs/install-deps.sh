#!/usr/bin/env bash
# Installs the Debian 12 packages kvside needs to build and test (idempotent).
set -euo pipefail
pkgs=(build-essential meson ninja-build pkg-config libzmq3-dev libmsgpack-dev liblmdb-dev
      libsodium-dev libxxhash-dev check python3 python3-zmq python3-msgpack clang libclang-rt-14-dev valgrind
      libyaml-dev libmicrohttpd-dev util-linux python3-torch python3-numpy python3-build
      python3-setuptools python3-wheel python3-venv prometheus python3-yaml python3-kubernetes
      redis-server redis-tools libhiredis-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${missing[@]}"
