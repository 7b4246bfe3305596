#!/usr/bin/env bash
# The whole test suite: unit + integration tests in a normal build and in an
# ASan+UBSan build, then the libFuzzer decoder harness for FUZZ_SECONDS (60).
# Ends with "N passed, N failed" summed over every run.
set -uo pipefail
cd "$(dirname "$0")/.."
./configs/install-deps.sh || exit 1
passed=0; failed=0
run_suite() { # build-dir label
  local log; log=$(mktemp)
  meson test -C "$1" --suite unit --suite integration --print-errorlogs 2>&1 | tee "$log"
  local ok fail to
  ok=$(awk '/^Ok:/{print $2}' "$log"); fail=$(awk '/^Fail:/{print $2}' "$log")
  to=$(awk '/^Timeout:/{print $2}' "$log")
  passed=$((passed + ${ok:-0})); failed=$((failed + ${fail:-0} + ${to:-0}))
  [ -n "$ok" ] || failed=$((failed + 1))
  echo "== $2: ${ok:-0} ok, ${fail:-0} failed, ${to:-0} timed out"
  rm -f "$log"
}
build() { # dir args...
  local d=$1; shift
  if [ ! -d "$d" ]; then meson setup "$d" "$@" >/dev/null || return 1; fi
  ninja -C "$d" >/dev/null || { ninja -C "$d"; return 1; }
}
if build build; then run_suite build "normal build"; else failed=$((failed + 1)); fi
if build build-asan -Db_sanitize=address,undefined -Db_lundef=false; then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    run_suite build-asan "ASan+UBSan build"
else failed=$((failed + 1)); fi
if [ -x tests/fuzz/run-fuzz.sh ]; then
  if FUZZ_SECONDS=${FUZZ_SECONDS:-60} tests/fuzz/run-fuzz.sh; then
    passed=$((passed + 1)); echo "== fuzz: ok"
  else failed=$((failed + 1)); echo "== fuzz: FAILED"; fi
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
