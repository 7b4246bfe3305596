#!/usr/bin/env bash
# The vLLM engine tests under the virtual environment make-venv.sh made
# (KVT_VLLM_VENV, default build-vllm-venv in the source root); exit 77 (skip)
# without it.
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVT_VLLM_VENV:-$here/../../build-vllm-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "no vLLM environment at $venv (tests/vllm_engine/make-venv.sh makes it): skipped"
  exit 77
fi
# the first argument names the test file (default test_vllm_engine.py)
file=test_vllm_engine.py
case "${1:-}" in *.py) file=$1; shift ;; esac
exec "$venv/bin/python" "$here/$file" "$@"
