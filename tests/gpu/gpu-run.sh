#!/usr/bin/env bash
# The GPU suite and the GPU benchmark in one go.
#   tests/gpu/gpu-run.sh local    build here and bundle the run-time libraries
#                                 (../shared/tools/gpu-bundle) into .gpu-bundle
#   tests/gpu/gpu-run.sh remote   on the GPU machine (carry build and .gpu-bundle):
#                                 run the GPU suite and `kvside-bench gpu`, logs in
#                                 ${OUT:-gpu-logs}/ (nvidia-smi.txt, gpu-suite.log,
#                                 gpu-bench.md, gpu-bench.err)
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
local)
  [ -d build ] || meson setup build >/dev/null
  ninja -C build || exit 1
  ../shared/tools/gpu-bundle
  ;;
remote)
  export LD_LIBRARY_PATH=$PWD/.gpu-bundle/lib:${LD_LIBRARY_PATH:-}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export KVS_SERVER=$PWD/build/server/kvside-server
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  rc=0
  timeout 500 build/tests/gpu/test_gpu > "$out/gpu-suite.log" 2>&1 || rc=$?
  echo "gpu suite: exit $rc"; tail -8 "$out/gpu-suite.log"
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
*)
  echo "usage: $0 local|remote" >&2
  exit 2
  ;;
esac
