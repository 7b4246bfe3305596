#!/usr/bin/env bash
# Builds the kvside Python wheel, offline, with Debian's python3-build,
# python3-setuptools and python3-wheel:
#   tools/build-wheel.sh [-b BUILD_DIR] [-l LIBKVSIDE] [OUT_DIR]
# BUILD_DIR: a normal (not sanitizer) meson build directory, default build/;
# LIBKVSIDE: the library to bundle, default BUILD_DIR/worker/libkvside.so.0;
# OUT_DIR: where the wheel goes, default BUILD_DIR/dist.
# Stages packaging/wheel/{pyproject.toml,setup.py}, worker/python/kvside, the
# library (as kvside/_lib/libkvside.so.0) and VERSION (meson.build's project
# version) into a temporary directory and runs
# `python3 -m build --wheel --no-isolation` there. $PYTHON picks the
# interpreter (default /usr/bin/python3, Debian's, where those packages are).
# Prints the wheel's path last.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=$root/build lib="" out=""
while getopts "b:l:h" o; do
  case $o in
    b) build_dir=$OPTARG ;;
    l) lib=$OPTARG ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -le 1 ] || { echo "build-wheel: one OUT_DIR at most" >&2; exit 2; }
lib=${lib:-$build_dir/worker/libkvside.so.0}
out=${1:-$build_dir/dist}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
[ -f "$lib" ] || { echo "build-wheel: $lib not found (build with meson first)" >&2; exit 1; }
# an ASan-instrumented library cannot be loaded into an uninstrumented python3
if command -v nm >/dev/null && grep -q '__asan_\|__ubsan_' <<<"$(nm -D --undefined-only "$lib")"; then
  echo "build-wheel: $lib is a sanitizer build; use a normal build directory" >&2; exit 1
fi
version=$(sed -n '/^project(/,/)/p' "$root/meson.build" | grep -o "version: *'[^']*'" | head -n1 |
          sed "s/.*'\(.*\)'/\1/")
[ -n "$version" ] || { echo "build-wheel: no project version in meson.build" >&2; exit 1; }

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvside-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$root/packaging/wheel/pyproject.toml" "$root/packaging/wheel/setup.py" "$stage/"
printf '%s\n' "$version" >"$stage/VERSION"
mkdir -p "$stage/kvside/vllm" "$stage/kvside/sglang" "$stage/kvside/_lib"
cp "$root"/worker/python/kvside/*.py "$stage/kvside/"
cp "$root"/worker/python/kvside/vllm/*.py "$stage/kvside/vllm/"
cp "$root"/worker/python/kvside/sglang/*.py "$stage/kvside/sglang/"
cp -L "$lib" "$stage/kvside/_lib/libkvside.so.0"   # the file, not the symlink
mkdir -p "$out"
out=$(cd "$out" && pwd)
(cd "$stage" && "$PYTHON" -m build --wheel --no-isolation --outdir "$out" . >"$stage/build.log" 2>&1) || {
  cat "$stage/build.log" >&2; echo "build-wheel: python3 -m build failed" >&2; exit 1; }
name=$(sed -n 's/^Successfully built \(kvside-.*\.whl\)$/\1/p' "$stage/build.log" | tail -n1)
if [ -z "$name" ] || [ ! -f "$out/$name" ]; then
  cat "$stage/build.log" >&2; echo "build-wheel: no wheel in the build's output" >&2; exit 1
fi
echo "$out/$name"
