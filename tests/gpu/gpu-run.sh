#!/usr/bin/env bash
# The GPU suite and the GPU benchmark in one go.
#   tests/gpu/gpu-run.sh local    build here and bundle the run-time libraries
#                                 (../shared/tools/gpu-bundle) into .gpu-bundle
#   tests/gpu/gpu-run.sh remote   on the GPU machine (carry build and .gpu-bundle):
#                                 run the GPU suite, the preload tests and
#                                 `kvside-bench gpu`, logs in ${OUT:-gpu-logs}/
#                                 (nvidia-smi.txt, gpu-suite-<path>.log, gpu-preload.log,
#                                 gpu-bench.md, gpu-bench.err)
#   tests/gpu/gpu-run.sh remote-bench the GPU benchmark alone (TAG names the
#                                 output, env such as KVS_CUDA_STAGE_BYTES=0
#                                 selects the engine's path)
#   tests/gpu/gpu-run.sh remote-vllm  the vLLM connector with CUDA tensors (vllm-connector.md)
#   tests/gpu/gpu-run.sh remote-cpu   the other bench modes on the same machine
#                                 (cpu-bench.md, cpu-bench.err); a separate call
#                                 keeps each under the device's 10-minute limit
#   tests/gpu/gpu-run.sh remote-e2e   prefix caching on transformers models
#                                 (tests/e2e/test_e2e_gpu.py: Llama, Mistral with a
#                                 sliding window, a Mamba hybrid; TP 2 rank processes;
#                                 L1 and L2; time to first token): e2e-gpu.log;
#                                 E2E_ARGS passes options (e.g. --no-timing,
#                                 --dump-src "$OUT"), E2E_TIMEOUT the limit (270 s)
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
  # the suite once per copy path: the default choice, every part staged
  # through tiny slots (segments cut at slot ends, slots reused many times),
  # and the kernel alone
  for v in default staged-tiny kernel-only; do
    case $v in
      default) envs=() ;;
      staged-tiny) envs=(KVS_CUDA_STAGE_MIN=0 KVS_CUDA_STAGE_BYTES=81920) ;;
      kernel-only) envs=(KVS_CUDA_STAGE_BYTES=0) ;;
    esac
    r=0
    env "${envs[@]}" timeout 300 build/tests/gpu/test_gpu > "$out/gpu-suite-$v.log" 2>&1 || r=$?
    [ $r -eq 0 ] || rc=$r
    echo "gpu suite ($v ${envs[*]}): exit $r"; grep -v '^[0-9][0-9]:' "$out/gpu-suite-$v.log" | tail -12
  done
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
  echo "gpu suite over $n GPUs: exit $rc"; grep -v '^[0-9][0-9]:' "$out/gpu-suite-multi.log" | tail -14
  timeout 400 build/tests/bench/kvside-bench gpu --spread --ranks "$n" > "$out/gpu-bench-multi.md" \
    2> "$out/gpu-bench-multi.err" || rc=$?
  cat "$out/gpu-bench-multi.md"
  exit $rc
  ;;
remote-vllm)
  # the vLLM connector with CUDA tensors: store/load byte-exact and its cost
  # next to raw libkvside calls (plain torch memory: legacy IPC; kvside cuMem)
  python_libs
  export KVS_SERVER=$PWD/build/server/kvside-server KVSIDE_LIB=$PWD/build/worker/libkvside.so
  export PYTHONPATH=$PWD/worker/python:$PWD/tests/vllm/stub PYTHONHASHSEED=0 KVT_LOG_LEVEL=info
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  rc=0
  for alloc in torch kvside; do
    timeout 240 python3 tests/vllm/bench_connector.py --device cuda --alloc $alloc --tokens 4096 \
      --layers 32 --reps 5 >> "$out/vllm-connector.md" 2>&1 || rc=$?
  done
  cat "$out/vllm-connector.md"
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
  echo "usage: $0 local|remote|remote-bench|remote-multi|remote-vllm|remote-cpu|remote-e2e" >&2
  exit 2
  ;;
esac
