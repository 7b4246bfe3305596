#!/usr/bin/env bash
# The Python wheel: tools/build-wheel.sh builds it from this build tree
# (libkvside.so from $KVS_LIB), a fresh plain venv (no system site packages:
# the package needs only the standard library) installs it with
# `pip install --no-index`, and tests/wheel/roundtrip.py runs there with
# KVSIDE_LIB and PYTHONPATH unset (python3 -I): the installed package and its
# bundled library against a real kvside-server ($KVS_SERVER).
# $KVT_VERSION: meson.build's project version, which the wheel must carry.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PY=${KVT_PYTHON:-/usr/bin/python3}
: "${KVS_LIB:?}" "${KVS_SERVER:?}" "${KVT_VERSION:?}"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvt-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

wheel=$(PYTHON=$PY "$root/tools/build-wheel.sh" -l "$KVS_LIB" "$tmp/dist" | tail -n1)
echo "built $wheel"
case $(basename "$wheel") in
  kvside-"$KVT_VERSION"-py3-none-linux_"$(uname -m)".whl) ;;
  *) fail "wheel name $(basename "$wheel"): want version $KVT_VERSION, tag py3-none-linux_$(uname -m)" ;;
esac
# what the wheel holds: the package, its subpackage, the library (a file, the built one)
"$PY" - "$wheel" "$KVS_LIB" <<'PYEOF'
import hashlib, sys, zipfile
wheel, lib = sys.argv[1:]
z = zipfile.ZipFile(wheel)
names = set(z.namelist())
want = {"kvside/__init__.py", "kvside/layout.py", "kvside/settings.py", "kvside/torch_alloc.py",
        "kvside/vllm/__init__.py", "kvside/vllm/connector.py", "kvside/vllm/config.py",
        "kvside/vllm/groups.py", "kvside/vllm/meta.py", "kvside/vllm/scheduler.py",
        "kvside/vllm/worker.py", "kvside/sglang/__init__.py", "kvside/sglang/config.py",
        "kvside/sglang/hybrid.py", "kvside/sglang/pools.py", "kvside/sglang/storage.py",
        "kvside/_lib/libkvside.so.0"}
missing = want - names
assert not missing, "missing from the wheel: %s" % sorted(missing)
extra = [n for n in names - want if not n.startswith("kvside-") or "/" not in n]
assert not extra, "unexpected in the wheel: %s" % extra
with open(lib, "rb") as f:
    assert z.read("kvside/_lib/libkvside.so.0") == f.read(), "bundled library differs from the built one"
meta = [n for n in names if n.endswith(".dist-info/WHEEL")]
wh = z.read(meta[0]).decode()
assert "Root-Is-Purelib: false" in wh, wh
print("wheel holds %d files, library byte-identical to %s" % (len(names), lib))
PYEOF

"$PY" -m venv "$tmp/venv"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$tmp/venv/bin/python" -m pip install -q --no-index "$wheel"
cd "$tmp"
env -u KVSIDE_LIB -u PYTHONPATH -u PYTHONHOME -u LD_LIBRARY_PATH \
  "$tmp/venv/bin/python" -I "$here/roundtrip.py"
echo "wheel test: ${SECONDS} s"
