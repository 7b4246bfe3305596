#!/bin/sh
# Fuzzes the protocol decoder with libFuzzer for FUZZ_SECONDS (default 60),
# then each other byte-parsing surface (fuzz_surfaces.c: lane frames, broker
# records, authorized-keys lines, replay requests, the YAML configuration)
# for a quarter of that.
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
ninja -C "$build" tests/fuzz/fuzz_decode tests/fuzz/seeds tests/fuzz/fuzz_frames tests/fuzz/fuzz_broker \
	tests/fuzz/fuzz_keys tests/fuzz/fuzz_replay tests/fuzz/fuzz_config

artifacts=$build/fuzz-artifacts
mkdir -p "$artifacts"

# run NAME SECONDS SEEDS [libFuzzer options...]: one target, its corpus kept
# in $build/fuzz-corpus[-NAME]
run() {
	name=$1 secs=$2 seeds=$3
	shift 3
	fuzzer=$build/tests/fuzz/fuzz_$name
	corpus=$build/fuzz-corpus${name#decode}
	[ "$name" = decode ] || corpus=$build/fuzz-corpus-$name
	log=$build/fuzz-$name.log
	mkdir -p "$corpus"
	echo "fuzz_$name: fuzzing for ${secs}s (log: $log)"
	rc=0
	"$fuzzer" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
		-artifact_prefix="$artifacts/$name-" -print_final_stats=1 "$@" "$corpus" "$seeds" >"$log" 2>&1 || rc=$?
	grep -E '^(Done [0-9]+ runs|stat::number_of_executed_units|stat::average_exec_per_sec|#[0-9]+[[:space:]]+DONE)' "$log" || true
	if [ "$rc" -ne 0 ]; then
		echo "fuzz_$name: FAILED (exit $rc); last lines of $log:" >&2
		tail -n 40 "$log" >&2
		ls -l "$artifacts" >&2 || true
		exit "$rc"
	fi
	echo "fuzz_$name: no crash; corpus now $(ls "$corpus" | wc -l) inputs"
}

# seeds of the other surfaces, from what the tests send
sd=$build/fuzz-seeds
mkdir -p "$sd/frames" "$sd/broker" "$sd/keys" "$sd/replay" "$sd/config"
printf '\003\005\000\000\000\201\241v\001\000\000\000\000\004\000\000\000abcd' >"$sd/frames/two"
printf '\001\000\000\000\000\001\000\000\200' >"$sd/frames/max"
printf 'KVSB\002\000\000\000\001\000\000\000\000\000\000\000%040d' 0 >"$sd/broker/v2"
printf 'KVSB\001\000\000\000%048d' 0 >"$sd/broker/v1"
printf '# engines\nrq:rGVBDp5C@/IxVlxQ9jRc0y4wv@3cyzuEIK]3e\nrq:rGVBDp5C@/IxVlxQ9jRc0y4wv@3cyzuEIK]3e admin # op\nnot-a-key\n' >"$sd/keys/file"
printf '\000\010\000\000\000\000\000\000\000\005' >"$sd/replay/req"
cp "$root/configs/kvside.yaml" "$sd/config/kvside.yaml"
printf 'l1-size: 2G\nbroker-dir: "/tmp/x"\nlog-level: &a info\n' >"$sd/config/small.yaml"

# the decoder gets FUZZ_SECONDS, every other surface a quarter of it
run decode "$seconds" "$build/tests/fuzz/seeds" -dict="$build/tests/fuzz/proto.dict" \
	$( [ "$jobs" -gt 1 ] && echo "-jobs=$jobs -workers=$jobs" )
q=$(( seconds / 4 > 0 ? seconds / 4 : 1 ))
for t in frames broker keys replay config; do
	run "$t" "$q" "$sd/$t"
done
