#!/usr/bin/env bash
# The whole test suite: unit + integration + bench-smoke + e2e + vllm +
# vllm-engine (real vLLM engines: the environment is made first) + sglang +
# wheel + ops + docs (every runnable block of README.md and docs/*.md) + l3 (the Redis Cluster client against a cluster the
# test starts) + chaos (faults injected into real servers, docs/reliability.md)
# in a normal build; the multi-process integration tests again
# with the server under valgrind (leaks and errors fail them); unit +
# integration in an ASan+UBSan build; then the libFuzzer decoder harness
# for FUZZ_SECONDS (60).
# Ends with "N passed, N failed" summed over every run.
set -uo pipefail
cd "$(dirname "$0")/.."
./configs/install-deps.sh --tests || exit 1
# the real vLLM of the engine tests, in its own virtual environment (pinned)
tests/vllm_engine/make-venv.sh build-vllm-venv || echo "== vllm-engine: environment not made (the tests skip)"
# the real SGLang of tests/sglang_pkg, in its own (pinned)
tests/vllm_engine/make-venv.sh build-sglang-venv tests/sglang_pkg/requirements.txt || echo "== sglang: environment not made (sglang_pkg skips)"
passed=0; failed=0
run_suite() { # build-dir label meson-test-args...
  local dir=$1 label=$2; shift 2
  local log; log=$(mktemp)
  meson test -C "$dir" "$@" --print-errorlogs 2>&1 | tee "$log"
  local ok fail to
  # meson's summary lines only ("Fail:   1"), the last of each: a failed
  # test's own output may hold lines that begin the same way
  count() { awk -v k="$1" '$1 == k":" && $2 ~ /^[0-9]+$/ && NF == 2 {n = $2} END {print n}' "$log"; }
  ok=$(count Ok); fail=$(count Fail); to=$(count Timeout)
  passed=$((passed + ${ok:-0})); failed=$((failed + ${fail:-0} + ${to:-0}))
  [ -n "$ok" ] || failed=$((failed + 1))
  echo "== $label: ${ok:-0} ok, ${fail:-0} failed, ${to:-0} timed out"
  rm -f "$log"
}
build() { # dir args...
  local d=$1; shift
  # an existing build directory is configured again: one made by ./demo.sh
  # before the test stack was installed has the tests left out (no Check)
  if [ ! -d "$d" ]; then meson setup "$d" "$@" >/dev/null || return 1
  else meson setup --reconfigure "$d" "$@" >/dev/null || return 1; fi
  ninja -C "$d" >/dev/null || { ninja -C "$d"; return 1; }
}
if build build; then
  run_suite build "normal build" --suite unit --suite integration --suite bench-smoke --suite e2e --suite vllm --suite vllm-engine --suite sglang --suite wheel --suite ops --suite docs --suite l3 --suite chaos
  run_suite build "server under valgrind" --setup valgrind spine jobs hybrid ops python_binding
else failed=$((failed + 1)); fi
if build build-asan -Db_sanitize=address,undefined -Db_lundef=false; then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    run_suite build-asan "ASan+UBSan build" --suite unit --suite integration
else failed=$((failed + 1)); fi
if [ -x tests/fuzz/run-fuzz.sh ]; then
  if FUZZ_SECONDS=${FUZZ_SECONDS:-60} tests/fuzz/run-fuzz.sh; then
    passed=$((passed + 1)); echo "== fuzz: ok"
  else failed=$((failed + 1)); echo "== fuzz: FAILED"; fi
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
