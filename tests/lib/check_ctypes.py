"""The Python binding's ctypes mirrors against the C headers.

Every ctypes.Structure of worker/python/kvside is the mirror of one struct of
the public headers (MIRRORS below), and every struct of those headers has a
mirror: same members in the same order (read from the header), and sizeof,
offsetof and member sizes equal to what the C compiler says (a small program
built here from the header). The binding's constant tables (error names, enum
values, key length, ABI version) are compared with the header's values the
same way. Fails on any difference: a member added to a C struct and not to
its mirror, a type changed on one side, an enum reordered.

    check_ctypes.py PYTHON_DIR HEADER...   (KVT_CC: the C compiler command;
    KVSIDE_LIB and PYTHONPATH: the built library and worker/python)"""

import ctypes
import os
import re
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cheader  # noqa: E402

import kvside  # noqa: E402

# binding class -> C typedef it mirrors
MIRRORS = {
    "_ClientConfig": "kvs_client_config", "_Event": "kvs_event", "_JobInfoOut": "kvs_job_info_out",
    "_StatOut": "kvs_stat_out", "_Alloc": "kvs_alloc", "_Group": "kvs_group", "_Layer": "kvs_layer",
    "_RegDesc": "kvs_registration_desc", "_Blocks": "kvs_blocks", "_StoreOpts": "kvs_store_opts",
    "_AdminInfo": "kvs_admin_info", "_Result": "kvs_result",
}
# public structs the binding deliberately does not mirror (none today)
NOT_MIRRORED = set()
# binding value (a Python expression in the kvside module) -> C constant
CONSTANTS = [("KEY_BYTES", "KVS_KEY_LEN"), ("ABI_VERSION", "KVS_ABI_VERSION"), ("REASON_LEN", "KVS_REASON_LEN"),
             ("_E_BASE", "KVS_E_BASE"), ("len(ERROR_NAMES)", "KVS_E_LAST_ - KVS_E_BASE + 1")]
CONSTANTS += [("%s + %d" % ("_E_BASE", i), "KVS_" + n) for i, n in enumerate(kvside.ERROR_NAMES)]
for table, names in [("_ROLES", {"scheduler": "KVS_ROLE_SCHEDULER", "worker": "KVS_ROLE_WORKER"}),
                     ("_KINDS", {"attention": "KVS_GROUP_ATTENTION", "recurrent": "KVS_GROUP_RECURRENT"}),
                     ("_ADMIN", {"status": "KVS_ADMIN_STATUS", "drain": "KVS_ADMIN_DRAIN",
                                 "resume": "KVS_ADMIN_RESUME", "clear": "KVS_ADMIN_CLEAR"})]:
    if set(getattr(kvside, table)) != set(names):
        sys.exit("FAIL: kvside.%s has keys %s, the test knows %s" % (table, sorted(getattr(kvside, table)),
                                                                     sorted(names)))
    CONSTANTS += [("%s[%r]" % (table, k), c) for k, c in names.items()]
for table, names in [("_STATES", ["KVS_JOB_OPEN", "KVS_JOB_COMMITTED", "KVS_JOB_ABORTED", "KVS_JOB_UNKNOWN"]),
                     ("_TIERS", ["KVS_TIER_L1", "KVS_TIER_L2", "KVS_TIER_L3"])]:
    if len(getattr(kvside, table)) != len(names):
        sys.exit("FAIL: kvside.%s has %d entries, the test knows %d" % (table, len(getattr(kvside, table)),
                                                                      len(names)))
    CONSTANTS += [("%s.index(%r)" % (table, v), c) for v, c in zip(getattr(kvside, table), names)]
CONSTANTS += [("{v: k for k, v in _EVENTS.items()}[%r]" % n, c)
              for n, c in [("reconnected", "KVS_EVENT_RECONNECTED"), ("job_done", "KVS_EVENT_JOB_DONE")]]

pydir, headers = sys.argv[1], sys.argv[2:]
failures = []

c_structs = {}
for h in headers:
    c_structs.update(cheader.structs(h))
py_classes = set()
for root, _, files in os.walk(pydir):
    for fn in files:
        if fn.endswith(".py"):
            with open(os.path.join(root, fn)) as f:
                py_classes |= set(re.findall(r"^class (\w+)\(ctypes\.Structure\)", f.read(), re.M))
for name in sorted(py_classes - set(MIRRORS)):
    failures.append("ctypes.Structure %s mirrors no known struct: add it to MIRRORS" % name)
for name in sorted(set(MIRRORS) - py_classes):
    failures.append("MIRRORS names %s, which the binding does not define" % name)
for name in sorted(set(c_structs) - set(MIRRORS.values()) - NOT_MIRRORED):
    failures.append("public struct %s has no mirror in the binding" % name)

# what the compiler says
lines = ["#include <stddef.h>", "#include <stdio.h>", "#include \"%s\"" % os.path.abspath(headers[0]),
         "int main(void)", "{"]
for cname in sorted(set(MIRRORS.values()) & set(c_structs)):
    lines.append('\tprintf("size %s %%zu\\n", sizeof(%s));' % (cname, cname))
    for m in c_structs[cname]:
        lines.append('\tprintf("member %s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));' % (
            cname, m, cname, m, cname, m))
for i, (_, c) in enumerate(CONSTANTS):
    lines.append('\tprintf("const %d %%lld\\n", (long long)(%s));' % (i, c))
lines += ["\treturn 0;", "}"]
with tempfile.TemporaryDirectory() as tmp:
    src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
    with open(src, "w") as f:
        f.write("\n".join(lines) + "\n")
    incs = ["-I" + os.path.dirname(os.path.abspath(h)) for h in headers]
    subprocess.run(shlex.split(os.environ.get("KVT_CC", "cc")) + ["-std=c17", "-o", exe, src] + incs,
                   check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
c_size, c_member, c_const = {}, {}, {}
for line in out.splitlines():
    f = line.split()
    if f[0] == "size":
        c_size[f[1]] = int(f[2])
    elif f[0] == "member":
        c_member[(f[1], f[2])] = (int(f[3]), int(f[4]))
    else:
        c_const[int(f[1])] = int(f[2])

checked = 0
for pyname, cname in sorted(MIRRORS.items()):
    cls = getattr(kvside, pyname, None)
    if cls is None or cname not in c_structs:
        continue
    py_members = [f[0] for f in cls._fields_]
    if py_members != c_structs[cname]:
        failures.append("%s members %s, C %s members %s" % (pyname, py_members, cname, c_structs[cname]))
        continue
    if ctypes.sizeof(cls) != c_size[cname]:
        failures.append("sizeof: %s %d, %s %d" % (pyname, ctypes.sizeof(cls), cname, c_size[cname]))
    for m in py_members:
        d = getattr(cls, m)
        if (d.offset, d.size) != c_member[(cname, m)]:
            failures.append("%s.%s at %d size %d, C at %d size %d" % (
                pyname, m, d.offset, d.size, *c_member[(cname, m)]))
    checked += 1
ns = vars(kvside)
for i, (expr, c) in enumerate(CONSTANTS):
    v = eval(expr, ns)
    if v != c_const[i]:
        failures.append("kvside %s = %d, C %s = %d" % (expr, v, c, c_const[i]))

print("%d structs (%d members) and %d constants compared with %s" % (
    checked, sum(len(c_structs[c]) for c in MIRRORS.values() if c in c_structs), len(CONSTANTS),
    ", ".join(os.path.basename(h) for h in headers)))
for f in failures:
    print("FAIL: " + f)
sys.exit(1 if failures else 0)
