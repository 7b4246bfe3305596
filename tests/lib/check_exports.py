"""libkvside.so exports exactly its API.

The API is every function the installed headers declare with KVS_EXPORT; a
function declared there without it is an error too (a program could not link
it). The test runs `nm -D --defined-only` on the built library and fails on
any symbol missing from it or exported beyond it; every libkvside function
the Python binding names (a quoted "kvs_..." in worker/python) must be part
of the API; and libkvside must not need liblmdb (readelf -d).

    check_exports.py LIBKVSIDE.so PYTHON_DIR HEADER..."""

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cheader  # noqa: E402

lib, pydir, headers = sys.argv[1], sys.argv[2], sys.argv[3:]
failures = []

api = set()
for h in headers:
    for name, exported in cheader.functions(h).items():
        if exported:
            api.add(name)
        else:
            failures.append("%s declares %s without KVS_EXPORT" % (os.path.basename(h), name))
if len(api) < 20:
    failures.append("only %d KVS_EXPORT declarations read from %s: the header reader is broken" % (
        len(api), headers))

out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True,
                     text=True).stdout
exported = set()
for line in out.splitlines():
    f = line.split()
    if len(f) >= 3:
        exported.add(f[2].split("@")[0])
for name in sorted(exported - api):
    failures.append("exported but not API: %s" % name)
for name in sorted(api - exported):
    failures.append("API but not exported: %s" % name)

# what the binding looks up by name (sigs in __init__.py, torch_alloc's allocator)
used = set()
for root, _, files in os.walk(pydir):
    for fn in files:
        if fn.endswith(".py"):
            with open(os.path.join(root, fn)) as f:
                used |= {n for n in re.findall(r"[\"'](kvs_\w+)[\"']", f.read()) if not n.endswith("_")}
if not used:
    failures.append("no kvs_ names found in %s" % pydir)
for name in sorted(used - api):
    failures.append("the Python binding uses %s, which is not in the public API" % name)

dyn = subprocess.run(["readelf", "-d", lib], check=True, capture_output=True, text=True).stdout
needed = re.findall(r"\(NEEDED\).*\[(.*)\]", dyn)
soname = re.findall(r"\(SONAME\).*\[(.*)\]", dyn)
for n in needed:
    if "lmdb" in n:
        failures.append("libkvside needs %s" % n)

print("%s (soname %s): %d symbols exported, %d declared with KVS_EXPORT, %d used by the binding; "
      "needs %s" % (lib, soname[0] if soname else "none", len(exported), len(api), len(used),
                    ", ".join(needed)))
print("exported: " + " ".join(sorted(exported)))
for f in failures:
    print("FAIL: " + f)
sys.exit(1 if failures else 0)
