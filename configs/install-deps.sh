#!/usr/bin/env bash
# Installs the Debian packages kvside needs to build and test (idempotent).
# Debian 12 and 13: an entry "a|b" is the first of a, b that the archive has
# (Debian 13 renamed some packages); it counts as present when any of them is
# installed. An entry the archive lacks under every name is reported and
# left out (what needs it skips or fails with its own message).
set -euo pipefail
pkgs=(build-essential meson ninja-build pkg-config libzmq3-dev "libmsgpack-c-dev|libmsgpack-dev" liblmdb-dev
      libsodium-dev libxxhash-dev check python3 python3-zmq python3-msgpack clang
      "libclang-rt-dev|libclang-rt-14-dev" valgrind procps libyaml-dev libmicrohttpd-dev util-linux python3-torch
      python3-numpy python3-build python3-setuptools python3-wheel python3-venv prometheus python3-yaml
      python3-kubernetes redis-server redis-tools libhiredis-dev)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
available() { [ -n "$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)" {print $2}')" ]; }
missing=()
for e in "${pkgs[@]}"; do
  have=0
  IFS='|' read -ra alts <<< "$e"
  for p in "${alts[@]}"; do installed "$p" && { have=1; break; }; done
  [ $have -eq 1 ] || missing+=("$e")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
names=()
for e in "${missing[@]}"; do
  IFS='|' read -ra alts <<< "$e"
  pick=""
  for p in "${alts[@]}"; do available "$p" && { pick=$p; break; }; done
  if [ -n "$pick" ]; then names+=("$pick"); else echo "install-deps.sh: no package '$e' in this archive: left out" >&2; fi
done
$SUDO apt-get install -y -qq --no-install-recommends "${names[@]}" >/dev/null
