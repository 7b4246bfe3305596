#!/usr/bin/env bash
# Installs the Debian packages kvside needs (idempotent; Debian 12 and 13).
#
#   configs/install-deps.sh           what building kvside and running ./demo.sh
#                                     need: the compiler, meson, ninja, pkg-config
#                                     and the libraries meson.build asks for
#   configs/install-deps.sh --tests   that, plus the test stack of
#                                     tests/run-all.sh (Check, valgrind, clang's
#                                     libFuzzer, Python with torch, Prometheus,
#                                     Redis, ...)
#
# An entry "a|b" is the first of a, b that the archive has (Debian 13 renamed
# some packages); it counts as present when any of them is installed. An entry
# the archive lacks under every name is reported and left out (what needs it
# skips or fails with its own message).
set -euo pipefail
tests=0
case "${1:-}" in
  "") ;;
  --tests) tests=1 ;;
  *) echo "usage: $0 [--tests]" >&2; exit 2 ;;
esac
# meson.build's dependency() calls, by pkg-config name: libzmq, msgpack-c (or
# msgpack before msgpack-c 6), lmdb, libxxhash, libsodium, yaml-0.1,
# libmicrohttpd, hiredis (optional: the Redis Cluster client of the L3 tier;
# small, and a server built without it has no l3-redis)
build=(build-essential meson ninja-build pkg-config libzmq3-dev "libmsgpack-c-dev|libmsgpack-dev"
       liblmdb-dev libsodium-dev libxxhash-dev libyaml-dev libmicrohttpd-dev libhiredis-dev)
# check: meson's dependency('check') (the unit and integration tests are built
# only when it is found); the rest: the tests' tools and Python packages
test=(check python3 python3-zmq python3-msgpack clang "libclang-rt-dev|libclang-rt-14-dev" valgrind
      procps util-linux curl python3-torch python3-numpy python3-build python3-setuptools python3-wheel
      python3-venv prometheus python3-yaml python3-kubernetes redis-server redis-tools)
pkgs=("${build[@]}")
[ $tests -eq 1 ] && pkgs+=("${test[@]}")
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
[ ${#names[@]} -eq 0 ] && exit 0
$SUDO apt-get install -y -qq --no-install-recommends "${names[@]}" >/dev/null
