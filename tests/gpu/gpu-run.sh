#!/usr/bin/env bash
# The GPU suite and the GPU benchmark in one go.
#   tests/gpu/gpu-run.sh local    build here and bundle the run-time libraries
#                                 (../shared/tools/gpu-bundle) into .gpu-bundle
#   tests/gpu/gpu-run.sh remote   on the GPU machine (carry build and .gpu-bundle):
#                                 run the GPU suite, the preload tests and
#                                 the start-up test (gpu-startup.log), `kvside-bench gpu`,
#                                 logs in ${OUT:-gpu-logs}/
#                                 (nvidia-smi.txt, gpu-suite-<path>.log, gpu-preload.log,
#                                 gpu-bench.md, gpu-bench.err)
#   tests/gpu/gpu-run.sh remote-suite the GPU suite alone, per copy path (SUITE_PATHS),
#                                 then test_gpu_gate (gpu-gate.log)
#   tests/gpu/gpu-run.sh remote-event stores after late and never-firing CUDA
#                                 producer events (test_gpu_event): gpu-event.log;
#                                 copies held past their job's deadline
#                                 (test_gpu_late): gpu-late.log
#   tests/gpu/gpu-run.sh remote-trace one rank, one job in flight, per block size
#                                 (TRACE_BLOCKS, KiB, default "4 16 2048") with
#                                 KVS_TRACE on: the bench's rows and where a
#                                 job's time goes (tools/kvs-trace-report),
#                                 once per env setting in TRACE_ENVS ("-" none,
#                                 else "VAR=v,VAR2=w"): trace-report.md
#   tests/gpu/gpu-run.sh remote-compare the GPU benchmark of BASE (build-base)
#                                 and build back to back (carry both)
#   tests/gpu/gpu-run.sh remote-ab    kvside-bench AB_MODES once per env in AB_ENVS
#                                 (default: KVS_LANE=0, then none): gpu-ab.md
#   tests/gpu/gpu-run.sh remote-bench the GPU benchmark alone (TAG names the
#                                 output, env such as KVS_CUDA_STAGE_BYTES=0
#                                 selects the engine's path)
#   tests/gpu/gpu-run.sh remote-vllm  the vLLM connector with CUDA tensors: its bench
#                                 (vllm-connector.md), then tests/vllm/test_connector.py
#                                 with KVT_DEVICE=cuda once per allocator (torch: legacy
#                                 IPC, kvside: cuMem), the two at once, each with its own
#                                 servers: vllm-connector-cuda-<alloc>.log, a per-case
#                                 summary appended to vllm-connector.md; VLLM_CASES picks
#                                 cases (unittest names, default all), VLLM_BENCH=0 skips
#                                 the bench, KVT_CUDA_DELAY_US the engine's spin (300);
#                                 then a control that must fail (writes on a stream the
#                                 connector does not wait for; VLLM_CONTROL=0 skips it)
#   tests/gpu/gpu-run.sh remote-cpu   the other bench modes on the same machine
#                                 (cpu-bench.md, cpu-bench.err); a separate call
#                                 keeps each under the device's 10-minute limit
#   tests/gpu/gpu-run.sh remote-e2e   prefix caching on transformers models
#                                 (tests/e2e/test_e2e_gpu.py: Llama, Mistral with a
#                                 sliding window, a Mamba hybrid; TP 2 rank processes;
#                                 L1 and L2; time to first token): e2e-gpu.log;
#                                 E2E_ARGS passes options (e.g. --no-timing,
#                                 --dump-src "$OUT"), E2E_TIMEOUT the limit (270 s)
#   tests/gpu/gpu-run.sh remote-qualify the seeds' qualification at their scale
#                                 (tests/gpu/qualify.py: 4 rank processes, a hybrid
#                                 cache as large as fits, a 524,288-token request,
#                                 engine-only and full restarts) once per memory
#                                 kind in QUAL_ALLOCS ("kvside torch"):
#                                 qualify-<kind>.md; QUAL_* settings pass through
set -uo pipefail
cd "$(dirname "$0")/../.."
# For python3 on the GPU machine: only the bundled libraries the machine lacks
# (python3 keeps its own libffi, libresolv...) go on LD_LIBRARY_PATH.
python_libs() {
  local lib f n
  lib=$(mktemp -d /tmp/kvside-py-lib.XXXXXX)
  ldconfig -p > "$lib/.have" 2>/dev/null
  for f in "$PWD"/.gpu-bundle/lib/*; do
    n=$(basename "$f")
    grep -q "^[[:space:]]*$n " "$lib/.have" || ln -s "$f" "$lib/$n"
  done
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
# The GPU suite once per copy path (SUITE_PATHS): the default choice, every
# part staged through tiny slots (segments cut at slot ends, slots reused many
# times), the kernel alone, completions by host functions only (the loop does
# not poll end events: the path every part takes while pinning runs), and
# every part of more than one object handed to the engine in waves, staged
# through tiny slots and by the kernel alone (copy-wave, plan.h).
suite_paths() {
  local rc=0 v r
  for v in ${SUITE_PATHS:-default staged-tiny kernel-only callbacks waves waves-kernel}; do
    case $v in
      default) envs=() ;;
      staged-tiny) envs=(KVS_CUDA_STAGE_MIN=0 KVS_CUDA_STAGE_BYTES=81920) ;;
      kernel-only) envs=(KVS_CUDA_STAGE_BYTES=0) ;;
      callbacks) envs=(KVS_CUDA_POLL_US=0) ;;
      waves) envs=(KVS_COPY_WAVE=4096 KVS_CUDA_STAGE_MIN=0 KVS_CUDA_STAGE_BYTES=81920) ;;
      waves-kernel) envs=(KVS_COPY_WAVE=4096 KVS_CUDA_STAGE_BYTES=0) ;;
    esac
    r=0
    env "${envs[@]}" timeout 300 build/tests/gpu/test_gpu > "$out/gpu-suite-$v.log" 2>&1 || r=$?
    [ $r -eq 0 ] || rc=$r
    echo "gpu suite ($v ${envs[*]}): exit $r"; grep -Ev '^[0-9]{4}-[0-9]{2}-[0-9]{2}T' "$out/gpu-suite-$v.log" | tail -12
  done
  # the loop never waits for L1's pin threads (test_gpu_gate: one copy path is enough)
  r=0
  timeout 120 build/tests/gpu/test_gpu_gate > "$out/gpu-gate.log" 2>&1 || r=$?
  [ $r -eq 0 ] || rc=$r
  echo "gpu gate: exit $r"; grep -Ev '^[0-9]{4}-[0-9]{2}-[0-9]{2}T' "$out/gpu-gate.log" | tail -4
  return $rc
}

case "${1:-}" in
local)
  [ -d build ] || meson setup build >/dev/null
  ninja -C build || exit 1
  ../shared/tools/gpu-bundle
  # the trace travels with the tree (../shared does not)
  cp ../shared/data/synthetic_trace.jsonl tests/gpu/synthetic_trace.jsonl
  grep -qx '/tests/gpu/synthetic_trace.jsonl' .git/info/exclude 2>/dev/null ||
    echo '/tests/gpu/synthetic_trace.jsonl' >> .git/info/exclude
  ;;
remote)
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  rc=0
  suite_paths || rc=$?
  # no stall at start-up with the largest L1 this machine allows (issue 18)
  r=0
  timeout 150 tests/gpu/test_startup.sh build/tests/bench/kvside-bench > "$out/gpu-startup.log" 2>&1 || r=$?
  [ $r -eq 0 ] || rc=$r
  echo "gpu startup: exit $r"; grep -E '^\| startup' "$out/gpu-startup.log" | head -7
  KVS_PRELOAD=$PWD/build/worker/libkvside-preload.so timeout 120 build/tests/gpu/test_preload \
    > "$out/gpu-preload.log" 2>&1 || rc=$?
  cat "$out/gpu-preload.log"
  # the same through PyTorch's own allocator (expandable segments use cuMemCreate)
  if python3 -c 'import torch' 2>/dev/null; then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 python3 tests/gpu/torch_preload_check.py \
      build/worker/libkvside.so >> "$out/gpu-preload.log" 2>&1
    LD_PRELOAD=$PWD/build/worker/libkvside-preload.so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      timeout 120 python3 tests/gpu/torch_preload_check.py build/worker/libkvside.so >> "$out/gpu-preload.log" 2>&1
    tail -2 "$out/gpu-preload.log"
  fi
  timeout 900 build/tests/bench/kvside-bench gpu ${BENCH_ARGS:-} > "$out/gpu-bench.md" 2> "$out/gpu-bench.err" || rc=$?
  cat "$out/gpu-bench.md"
  exit $rc
  ;;
remote-suite)
  # the GPU suite alone, once per SUITE_PATHS entry
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  suite_paths
  exit $?
  ;;
remote-event)
  # stores after CUDA producer events (late, never firing): test_gpu_event;
  # copies held past their deadline: test_gpu_late
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  for t in event late; do
    r=0
    timeout 120 build/tests/gpu/test_gpu_$t > "$out/gpu-$t.log" 2>&1 || r=$?
    [ $r -eq 0 ] || rc=$r
    echo "gpu $t test: exit $r"; grep -Ev '^[0-9]{4}-[0-9]{2}-[0-9]{2}T' "$out/gpu-$t.log" | tail -8
  done
  exit $rc
  ;;
remote-compare)
  # the GPU benchmark of two builds back to back on this machine, the same
  # run configuration: BASE (default build-base, e.g. the previous commit's
  # build carried along) then build; gpu-bench-base.md, gpu-bench-new.md
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  base=${BASE:-build-base}
  rc=0
  for b in "$base:base" "build:new"; do
    dir=${b%%:*} tag=${b##*:}
    KVS_SERVER=$PWD/$dir/server/kvside-server timeout 280 $dir/tests/bench/kvside-bench gpu ${BENCH_ARGS:-} \
      > "$out/gpu-bench-$tag.md" 2> "$out/gpu-bench-$tag.err" || rc=$?
    echo "== $tag ($dir)"; cat "$out/gpu-bench-$tag.md"
  done
  exit $rc
  ;;
remote-trace)
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  for envs in ${TRACE_ENVS:--}; do
    for kib in ${TRACE_BLOCKS:-4 16 2048}; do
      d=$(mktemp -d)
      echo "== $envs, ${kib} KiB blocks, ${TRACE_CFG:-1x1}"
      ( [ "$envs" = - ] || export ${envs//,/ }
        KVS_TRACE=$d timeout 200 build/tests/bench/kvside-bench gpu --gpu-cfg "${TRACE_CFG:-1x1}" \
          --gpu-blocks "$kib" ${BENCH_ARGS:-} 2>&1 | grep -E "^\| gpu (store|retrieve)|breakdown" ) || rc=$?
      python3 tools/kvs-trace-report "$d" --skip 8 || rc=$?
      rm -rf "$d"
    done
  done 2>&1 | tee "$out/trace-report.md"
  exit $rc
  ;;
remote-ab)
  # kvside-bench AB_MODES (default "gpu control") once per env setting in
  # AB_ENVS ("-" none, else "VAR=v,VAR2=w"; default "KVS_LANE=0 -": ZeroMQ
  # only, then the job lane), back to back on one machine: gpu-ab.md
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  for e in ${AB_ENVS:-KVS_LANE=0 -}; do
    envs=()
    [ "$e" = "-" ] || IFS=, read -ra envs <<< "$e"
    echo "## env: $e" | tee -a "$out/gpu-ab.md"
    env "${envs[@]}" timeout "${AB_TIMEOUT:-240}" build/tests/bench/kvside-bench ${AB_MODES:-gpu control} \
      ${BENCH_ARGS:-} >> "$out/gpu-ab.md" 2>> "$out/gpu-ab.err" || rc=$?
  done
  grep -E '^(## env|\| )' "$out/gpu-ab.md"
  exit $rc
  ;;
remote-bench)
  # the GPU benchmark alone, e.g. KVS_CUDA_STAGE_BYTES=0 for the kernel-only
  # engine next to the default: gpu-bench${TAG}.md
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  timeout 560 build/tests/bench/kvside-bench gpu ${BENCH_ARGS:-} > "$out/gpu-bench${TAG:-}.md" \
    2> "$out/gpu-bench${TAG:-}.err" || rc=$?
  cat "$out/gpu-bench${TAG:-}.md"
  exit $rc
  ;;
remote-multi)
  # several GPUs: the suite with rank r on GPU r % n, and the bench with one
  # rank per GPU against each GPU's own ceiling (NVLink multicast stays off)
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  nvidia-smi -L > "$out/nvidia-smi.txt" 2>&1
  n=$(nvidia-smi -L | grep -c '^GPU')
  rc=0
  KVS_GPU_SPREAD=1 timeout 300 build/tests/gpu/test_gpu > "$out/gpu-suite-multi.log" 2>&1 || rc=$?
  echo "gpu suite over $n GPUs: exit $rc"; grep -Ev '^[0-9]{4}-[0-9]{2}-[0-9]{2}T' "$out/gpu-suite-multi.log" | tail -14
  timeout 400 build/tests/bench/kvside-bench gpu --spread --ranks "$n" > "$out/gpu-bench-multi.md" \
    2> "$out/gpu-bench-multi.err" || rc=$?
  cat "$out/gpu-bench-multi.md"
  exit $rc
  ;;
remote-vllm)
  # the vLLM connector with CUDA tensors: store/load byte-exact and its cost
  # next to raw libkvside calls (plain torch memory: legacy IPC; kvside cuMem),
  # then its test suite on CUDA KV caches
  python_libs
  export KVS_SERVER=$PWD/build/server/kvside-server KVSIDE_LIB=$PWD/build/worker/libkvside.so
  export PYTHONPATH=$PWD/worker/python:$PWD/tests/vllm/stub PYTHONHASHSEED=0 KVT_LOG_LEVEL=info
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  if [ "${VLLM_BENCH:-1}" != 0 ]; then
    for alloc in torch kvside; do
      timeout 240 python3 tests/vllm/bench_connector.py --device cuda --alloc $alloc --tokens 4096 \
        --layers 32 --reps 5 >> "$out/vllm-connector.md" 2>&1 || rc=$?
    done
    cat "$out/vllm-connector.md"
  fi
  # the connector suite in vLLM's call order on CUDA KV caches (tests/vllm/engine.py,
  # KVT_DEVICE=cuda): both allocators at once, each in its own TMPDIR (servers, engine logs)
  declare -A pid tmp
  # vllm_start NAME ALLOC TIMEOUT CASES [ENV=VALUE...]: test_connector.py in the background
  vllm_start() {
    local name=$1 alloc=$2 limit=$3 cases=$4
    shift 4
    tmp[$name]=$(mktemp -d "/tmp/kvt-$name.XXXXXX")
    # shellcheck disable=SC2086
    env TMPDIR="${tmp[$name]}" KVT_DEVICE=cuda KVT_CUDA_ALLOC="$alloc" KVT_KEEP_LOGS=1 PYTHONUNBUFFERED=1 "$@" \
      timeout "$limit" python3 tests/vllm/test_connector.py -v $cases > "$out/vllm-connector-$name.log" 2>&1 &
    pid[$name]=$!
  }
  # vllm_report NAME TITLE: waits, appends one line per case to vllm-connector.md; sets r
  vllm_report() {
    local name=$1 title=$2
    r=0
    wait "${pid[$name]}" || r=$?
    {
      echo
      echo "$title: exit $r"
      echo '```'
      # one line per case (unittest -v prints the name, then the docstring's first line)
      python3 - "$out/vllm-connector-$name.log" <<'PY'
import re, sys
t = re.sub(r"logs kept in \S+\n", "", open(sys.argv[1], errors="replace").read())
for m in re.finditer(r"^(test_\w+) \(([\w.]+)\)(?:\n[^\n]*?)? \.\.\. (.*)$", t, re.M):
    print("%-48s %s" % (m.group(2).split(".", 1)[-1], m.group(3)))
for m in re.finditer(r"^(Ran .*|OK.*|FAILED.*)$", t, re.M):
    print(m.group(1))
for block in re.split(r"^={20,}$", t, flags=re.M):
    m = re.search(r"^(FAIL|ERROR): (test_\w+)", block, re.M)
    # the innermost exception, before the processes' log tails
    e = re.findall(r"^([\w.]+(?:Error|Failure|Exception)\b.*)$", block.split("\n---- ")[0], re.M)
    if m:
        print("%s %s: %s" % (m.group(1), m.group(2), (e[-1] if e else "?")[:400]))
PY
      echo '```'
    } | tee -a "$out/vllm-connector.md"
    # the engine's process logs, when a case failed
    [ $r -eq 0 ] || tar -C "${tmp[$name]}" -czf "$out/vllm-connector-$name-logs.tgz" . 2>/dev/null
    rm -rf "${tmp[$name]}"
  }
  for alloc in torch kvside; do
    vllm_start "cuda-$alloc" $alloc "${VLLM_TEST_TIMEOUT:-270}" "${VLLM_CASES:-}"
  done
  for alloc in torch kvside; do
    vllm_report "cuda-$alloc" \
      "test_connector.py KVT_DEVICE=cuda KVT_CUDA_ALLOC=$alloc KVT_CUDA_DELAY_US=${KVT_CUDA_DELAY_US:-300}"
    [ $r -eq 0 ] || rc=$r
  done
  # the control (VLLM_CONTROL=0 skips it): the engine's KV writes on a side stream
  # (KVT_CUDA_WRITE_STREAM=side) that the connector's wait_for_save does not
  # synchronise; these cases must fail (stale bytes stored and loaded), else the
  # suite could not see a store that does not wait for the stream. Not in the exit code.
  if [ "${VLLM_CONTROL:-1}" != 0 ]; then
    for alloc in torch kvside; do
      vllm_start "control-$alloc" $alloc 150 \
        "Connector.test_tp2_shared_prefix_stored_then_loaded Connector.test_preemption_while_saving" \
        KVT_CUDA_WRITE_STREAM=side
    done
    for alloc in torch kvside; do
      vllm_report "control-$alloc" "control (expected to FAIL): KVT_CUDA_WRITE_STREAM=side KVT_CUDA_ALLOC=$alloc"
    done
  fi
  # layer tensors of plain PyTorch with expandable segments (one tensor over
  # several cuMem allocations) under the preload interposer (issue 19)
  if [ "${VLLM_SPAN:-1}" != 0 ]; then
    r=0
    LD_PRELOAD=$PWD/build/worker/libkvside-preload.so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      PYTHONPATH=$PYTHONPATH:$PWD/tests/python timeout 180 python3 tests/gpu/torch_span_check.py \
      > "$out/torch-span.log" 2>&1 || r=$?
    echo "torch_span_check.py: exit $r"; cat "$out/torch-span.log"
    [ $r -eq 0 ] || rc=$r
  fi
  exit $rc
  ;;
remote-qualify)
  python_libs
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export KVS_SERVER=$PWD/build/server/kvside-server KVSIDE_LIB=$PWD/build/worker/libkvside.so
  export PYTHONPATH=$PWD/worker/python:$PWD/tests/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  export KVT_LOG_LEVEL=info
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  { nvidia-smi; free -g; df -h . /tmp; nproc; } > "$out/machine.txt" 2>&1
  rc=0
  for a in ${QUAL_ALLOCS:-kvside torch}; do
    r=0
    QUAL_ALLOC=$a timeout "${QUAL_TIMEOUT:-560}" python3 tests/gpu/qualify.py > "$out/qualify-$a.md" 2>&1 || r=$?
    [ $r -eq 0 ] || rc=$r
    echo "== qualify $a: exit $r"; sed -n '/^## Summary/,$p' "$out/qualify-$a.md"
    [ $r -eq 0 ] || tail -40 "$out/qualify-$a.md"
  done
  exit $rc
  ;;
remote-cpu)
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  timeout 560 build/tests/bench/kvside-bench copy control l2 trace restart memory --ranks 4 \
    --trace tests/gpu/synthetic_trace.jsonl > "$out/cpu-bench.md" 2> "$out/cpu-bench.err"
  rc=$?
  cat "$out/cpu-bench.md"
  exit $rc
  ;;
remote-e2e)
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  python_libs
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export KVS_SERVER=$PWD/build/server/kvside-server KVSIDE_LIB=$PWD/build/worker/libkvside.so
  export PYTHONPATH=$PWD/worker/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  # shellcheck disable=SC2086
  timeout "${E2E_TIMEOUT:-270}" python3 tests/e2e/test_e2e_gpu.py ${E2E_ARGS:-} > "$out/e2e-gpu.log" 2>&1
  rc=$?
  cat "$out/e2e-gpu.log"
  echo "remote-e2e: exit $rc"
  exit $rc
  ;;
*)
  echo "usage: $0 local|remote|remote-bench|remote-multi|remote-vllm|remote-cpu|remote-e2e|remote-qualify" >&2
  exit 2
  ;;
esac
