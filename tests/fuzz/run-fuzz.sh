#!/bin/sh
# Fuzzes the protocol decoder with libFuzzer for FUZZ_SECONDS (default 60).
#
# Builds a separate clang build directory (FUZZ_BUILD_DIR, default
# build-fuzz) with -Dfuzz=true, generates the seed corpus and dictionary from
# valid messages, and runs tests/fuzz/fuzz_decode (ASan + UBSan). New inputs
# go to $FUZZ_BUILD_DIR/fuzz-corpus (kept between runs); a crashing input is
# written to $FUZZ_BUILD_DIR/fuzz-artifacts/. Exits non-zero on any crash,
# sanitizer report, leak or timeout.
#
# Environment: FUZZ_SECONDS, FUZZ_BUILD_DIR, FUZZ_JOBS (parallel workers,
# default 1), FUZZ_MAX_LEN (default 65536), CC (default clang).
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-1}
max_len=${FUZZ_MAX_LEN:-65536}

if [ ! -f "$build/build.ninja" ]; then
	CC=${CC:-clang} meson setup "$build" "$root" -Dfuzz=true -Db_sanitize=none \
		-Dbuildtype=debugoptimized
fi
# Only the fuzz targets: the rest of the tree need not build under clang.
ninja -C "$build" tests/fuzz/fuzz_decode tests/fuzz/seeds

fuzzer=$build/tests/fuzz/fuzz_decode
seeds=$build/tests/fuzz/seeds
dict=$build/tests/fuzz/proto.dict
corpus=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
log=$build/fuzz.log
mkdir -p "$corpus" "$artifacts"

set -- -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
	-dict="$dict" -artifact_prefix="$artifacts/" -print_final_stats=1
if [ "$jobs" -gt 1 ]; then
	set -- "$@" -jobs="$jobs" -workers="$jobs"
fi

echo "fuzz_decode: fuzzing for ${seconds}s (log: $log)"
rc=0
"$fuzzer" "$@" "$corpus" "$seeds" >"$log" 2>&1 || rc=$?

# libFuzzer's summary lines
grep -E '^(Done [0-9]+ runs|stat::number_of_executed_units|stat::average_exec_per_sec|#[0-9]+[[:space:]]+DONE)' "$log" || true
if [ "$rc" -ne 0 ]; then
	echo "fuzz_decode: FAILED (exit $rc); last lines of $log:" >&2
	tail -n 40 "$log" >&2
	ls -l "$artifacts" >&2 || true
	exit "$rc"
fi
echo "fuzz_decode: no crash; corpus now $(ls "$corpus" | wc -l) inputs"
