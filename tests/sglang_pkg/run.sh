#!/usr/bin/env bash
# The real-SGLang tests under the virtual environment make-venv.sh made from
# tests/sglang_pkg/requirements.txt (KVT_SGLANG_VENV, default
# build-sglang-venv in the source root); exit 77 (skip) without it.
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVT_SGLANG_VENV:-$here/../../build-sglang-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "no SGLang environment at $venv (tests/vllm_engine/make-venv.sh DIR tests/sglang_pkg/requirements.txt makes it): skipped"
  exit 77
fi
exec "$venv/bin/python" "$here/test_sglang_pkg.py" "$@"
