#!/usr/bin/python3
"""The Kubernetes manifests configs/k8s/*.yaml against this tree:

  * every file parses as YAML (python3-yaml); every document has apiVersion,
    kind and metadata.name, and its fields are fields of the Kubernetes API
    (the models of Debian's python3-kubernetes, plus the native-sidecar
    restartPolicy of containers, Kubernetes 1.28+), with the right shapes;
  * every kvside-server / kvside-ctl command line (container command and
    args, preStop hooks, init-container shell scripts) uses only options
    listed by the binary's --help (and kvside-ctl a command it lists); the
    server's configuration file (the ConfigMap mounted where --config points)
    uses only keys of configs/kvside.yaml, and `kvside-server --config <it>
    <args> --print-config` accepts the whole command line;
  * absolute paths into the kvside image (binaries, the client library and
    Python package the init containers copy) are where configs/Containerfile
    puts this tree's `meson install` (build/meson-info/intro-installed.json,
    prefix /usr/local);
  * the server and the vLLM containers share the broker directory: the
    server's effective broker-dir, the connector's broker_dir
    (--kv-transfer-config), and every kvside-ctl --broker-dir are one path,
    on one volume (the same emptyDir of the Pod, or the same hostPath of the
    node); same runAsUser/runAsGroup; IPC shared (one Pod, or hostIPC on
    both) and /dev/shm the same (one Memory emptyDir in both containers, or
    the host's); a root init container preparing node directories gives them
    to that UID;
  * probes: liveness and startup httpGet /healthz, readiness /readyz, on the
    port named kvside-metrics, which is the effective metrics-listen port,
    listening on all interfaces (the kubelet probes the Pod IP); the memory
    limit covers l1-size; with a read-only root file system the broker and
    L2 directories are on writable volumes;
  * the connector: kv_connector_module_path is a package of this tree that
    exports kv_connector, kv_connector_extra_config has only keys (of the
    right types) of kvside.vllm.config.ConnectorConfig, PYTHONHASHSEED is set
    and PYTHONPATH/KVSIDE_LIB point where the init container copied the
    package and the library.
"""

import ast
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile

import yaml

import opscheck

c = opscheck.Checks("k8s")
ROOT = opscheck.ROOT
IMAGE_PREFIX = "/usr/local"


def is_kvside_image(image):
    return bool(re.search(r'(^|/)kvside(:|@|$)', image or ""))


# ---- what this tree provides ----------------------------------------------------------

def help_options(binary):
    """{--option: takes a value} and the list of commands from --help."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    opts, cmds = {}, []
    in_cmds = False
    for line in text.splitlines():
        if re.match(r'^Commands:', line):
            in_cmds = True
            continue
        if re.match(r'^\S', line):
            in_cmds = False
        if in_cmds:
            m = re.match(r'^\s{2}([a-z][a-z-]*)\b', line)
            if m:
                cmds.append(m.group(1))
            continue
        m = re.match(r'^\s+(--[a-z0-9-]+(?:,\s*--[a-z0-9-]+)*)(\s+([A-Z][A-Z0-9_:]*))?', line)
        if m:
            for o in re.split(r',\s*', m.group(1)):
                opts[o] = bool(m.group(3))
    return opts, cmds


SERVER_OPTS, _ = help_options(opscheck.SERVER)
CTL_OPTS, CTL_CMDS = help_options(opscheck.CTL)
c.ok("--broker-dir" in SERVER_OPTS and "--config" in SERVER_OPTS and CTL_CMDS,
     "read the options of kvside-server and kvside-ctl from --help (%d, %d options, commands %s)"
     % (len(SERVER_OPTS), len(CTL_OPTS), CTL_CMDS))

with open(os.path.join(ROOT, "configs", "kvside.yaml")) as f:
    CONFIG_KEYS = set(re.findall(r'^(?:#\s?)?([a-z][a-z0-9-]*):(?:\s|$)', f.read(), re.M))
c.ok({"l1-size", "broker-dir", "metrics-listen"} <= CONFIG_KEYS, "read the keys of configs/kvside.yaml")

with open(os.path.join(ROOT, "configs", "Containerfile")) as f:
    cf = f.read()
c.ok("--prefix=%s" % IMAGE_PREFIX in cf and "COPY --from=build /out%s %s" % (IMAGE_PREFIX, IMAGE_PREFIX) in cf,
     "configs/Containerfile installs under %s" % IMAGE_PREFIX)


def installed_paths():
    with open(os.path.join(opscheck.BUILD, "meson-info", "intro-installed.json")) as f:
        inst = json.load(f)
    with open(os.path.join(opscheck.BUILD, "meson-info", "intro-buildoptions.json")) as f:
        prefix = [o["value"] for o in json.load(f) if o["name"] == "prefix"][0]
    out = set()
    for p in inst.values():
        if p.startswith(prefix + "/"):
            p = IMAGE_PREFIX + p[len(prefix):]
        out.add(p)
    return out


INSTALLED = installed_paths()
INSTALLED_DIRS = {os.path.dirname(p) for p in INSTALLED}
d = set()
for p in INSTALLED_DIRS:
    while p and p != "/":
        d.add(p)
        p = os.path.dirname(p)
INSTALLED_DIRS = d


def connector_fields():
    """ConnectorConfig's fields and the types of their defaults (ast, no import)."""
    path = os.path.join(ROOT, "worker", "python", "kvside", "vllm", "config.py")
    tree = ast.parse(open(path).read())
    fields = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ConnectorConfig":
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    v = st.value.value if isinstance(st.value, ast.Constant) else None
                    fields[st.target.id] = (type(v) if v is not None else None, st.annotation.id
                                            if isinstance(st.annotation, ast.Name) else None)
    return fields


# ---- Kubernetes API shapes (python3-kubernetes models) -------------------------------

try:
    from kubernetes.client import models as k8s_models
except ImportError:
    k8s_models = None
c.ok(k8s_models is not None, "python3-kubernetes is installed (the API field check needs it)")
NEWER_FIELDS = {("V1Container", "restartPolicy"): "str"}  # native sidecars, Kubernetes 1.28+
KINDS = {"Pod": "V1Pod", "ConfigMap": "V1ConfigMap", "DaemonSet": "V1DaemonSet", "Service": "V1Service",
         "Deployment": "V1Deployment", "StatefulSet": "V1StatefulSet", "NetworkPolicy": "V1NetworkPolicy"}


def check_shape(value, typ, where):
    if typ in ("object", None):
        return
    m = re.fullmatch(r'list\[(.+)\]', typ)
    if m:
        if c.ok(isinstance(value, list), "%s: a list" % where):
            for i, v in enumerate(value):
                check_shape(v, m.group(1), "%s[%d]" % (where, i))
        return
    m = re.fullmatch(r'dict\(str, (.+)\)', typ)
    if m:
        if c.ok(isinstance(value, dict), "%s: a mapping" % where):
            for k, v in value.items():
                check_shape(v, m.group(1), "%s.%s" % (where, k))
        return
    prim = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}
    if typ in prim:
        ok = isinstance(value, prim[typ]) and not (typ == "int" and isinstance(value, bool))
        if typ == "str" and re.search(r'\.(limits|requests)\.|\.sizeLimit$', where):
            ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool))  # a quantity
        c.ok(ok, "%s: a %s, not %r" % (where, typ, value))
        return
    cls = getattr(k8s_models, typ, None)
    if not c.ok(cls is not None, "%s: API type %s known" % (where, typ)):
        return
    if not c.ok(isinstance(value, dict), "%s: a %s mapping" % (where, typ)):
        return
    by_json = {j: cls.openapi_types[py] for py, j in cls.attribute_map.items()}
    for k, v in value.items():
        t = by_json.get(k) or NEWER_FIELDS.get((typ, k))
        if c.ok(t is not None, "%s: %s is a field of %s" % (where, k, typ)):
            check_shape(v, t, "%s.%s" % (where, k))


# ---- reading pod specs ---------------------------------------------------------------

def pod_specs(docs):
    for d in docs:
        if d.get("kind") == "Pod":
            yield d["metadata"]["name"], d, d.get("spec", {})
        elif d.get("kind") in ("DaemonSet", "Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d, d["spec"]["template"].get("spec", {})


def all_containers(spec):
    return [("init", x) for x in spec.get("initContainers", [])] + [("main", x) for x in spec.get("containers", [])]


def sec(spec, cont, key):
    v = (cont.get("securityContext") or {}).get(key)
    return v if v is not None else (spec.get("securityContext") or {}).get(key)


def mount_for(spec, cont, path):
    """(mount, volume, path relative to the mount) of the longest mount holding path."""
    best = None
    for m in cont.get("volumeMounts", []) or []:
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[0]["mountPath"].rstrip("/")):
                best = (m, os.path.relpath(path, mp) if path != mp else ".")
    if not best:
        return None
    vol = [v for v in spec.get("volumes", []) if v["name"] == best[0]["name"]]
    return best[0], (vol[0] if vol else None), best[1]


def storage_of(pod, spec, cont, path):
    """Where a container path lives: the same key means the same bytes."""
    m = mount_for(spec, cont, path)
    if not m or not m[1]:
        return None
    mount, vol, rel = m
    if mount.get("subPath"):
        rel = os.path.normpath(os.path.join(mount["subPath"], rel))
    if "hostPath" in vol:
        return ("node", os.path.normpath(os.path.join(vol["hostPath"]["path"], rel)))
    return ("pod", pod, vol["name"], os.path.normpath(rel))


def argvs(cont):
    """Every command line a container runs: command + args, hooks, exec probes."""
    out = []
    if cont.get("command") or cont.get("args"):
        out.append([str(x) for x in (cont.get("command") or []) + (cont.get("args") or [])])
    for hook in (cont.get("lifecycle") or {}).values():
        if "exec" in hook:
            out.append([str(x) for x in hook["exec"]["command"]])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        p = cont.get(probe) or {}
        if "exec" in p:
            out.append([str(x) for x in p["exec"]["command"]])
    return out


SHELL_OPS = {";", "&&", "||", "|", "&", "(", ")"}
SHELL_WORDS = {"until", "while", "if", "then", "do", "done", "else", "fi", "!", "{", "}"}


def simple_commands(argv):
    """A shell script's simple commands (command substitutions included), or
    the argv itself; (commands, {variable: command it is assigned from})."""
    if os.path.basename(argv[0]) in ("sh", "bash", "dash") and "-c" in argv:
        script = argv[argv.index("-c") + 1]
    else:
        return [argv], {}
    cmds, assigns = [], {}
    for line in script.splitlines():
        m = re.match(r'^\s*(\w+)=\$\((.*)\)\s*$', line)
        if m:
            assigns[m.group(1)] = shlex.split(m.group(2).split("|")[0])
        line = line.replace("$(", " ; ").replace(")", " ; ")
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        cur = []
        for tok in lex:
            if tok in SHELL_OPS:
                if cur:
                    cmds.append(cur)
                cur = []
            elif not cur and (tok in SHELL_WORDS or re.match(r'^\w+=', tok)):
                continue
            else:
                cur.append(tok)
        if cur:
            cmds.append(cur)
    return cmds, assigns


def parse_invocation(cmd, opts, where):
    """{option: value}, positional args; checks every option exists."""
    got, pos = {}, []
    i = 1
    while i < len(cmd):
        a = cmd[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if c.ok(name in opts, "%s: %s is an option of %s --help" % (where, name, os.path.basename(cmd[0]))):
                if opts[name] and not eq:
                    i += 1
                    val = cmd[i] if i < len(cmd) else None
                    c.ok(val is not None, "%s: %s takes a value" % (where, name))
                got[name] = val
        else:
            pos.append(a)
        i += 1
    return got, pos


def k8s_bytes(q):
    m = re.fullmatch(r'(\d+(?:\.\d+)?)([KMGTPE]i?)?', str(q))
    if not m:
        return None
    mult = {None: 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
    return float(m.group(1)) * mult[m.group(2)]


def kvside_bytes(s):
    m = re.fullmatch(r'(\d+)([KMGT])?', str(s))
    return int(m.group(1)) << {None: 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


# ---- the checks ------------------------------------------------------------------------

files = sorted(glob.glob(os.path.join(opscheck.K8S_DIR, "*.yaml")) +
               glob.glob(os.path.join(opscheck.K8S_DIR, "*.yml")))
c.ok(len(files) >= 2, "configs/k8s has the Pod and the DaemonSet manifests: %s" % files)
kinds_seen = set()
copied_pkgs, connector_modules = [], set()
for path in files:
    fname = os.path.relpath(path, ROOT)
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except yaml.YAMLError as e:
        c.fail("%s parses as YAML: %s" % (fname, e))
        continue
    c.ok(docs, "%s: has documents" % fname)
    for d in docs:
        ok = isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and (d.get("metadata") or {}).get("name")
        if not c.ok(ok, "%s: a document with apiVersion, kind, metadata.name" % fname):
            continue
        kinds_seen.add(d["kind"])
        typ = KINDS.get(d["kind"])
        if c.ok(typ, "%s: kind %s is one this test knows" % (fname, d["kind"])) and k8s_models:
            check_shape(d, typ, "%s %s/%s" % (fname, d["kind"], d["metadata"]["name"]))
    docs = [d for d in docs if isinstance(d, dict)]
    configmaps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}

    servers, engines, ctl_dirs, preparers = [], [], [], []
    for pod, doc, spec in pod_specs(docs):
        for kind, cont in all_containers(spec):
            where = "%s %s/%s" % (fname, pod, cont["name"])
            kv_image = is_kvside_image(cont.get("image"))
            if kv_image:
                c.ok(cont.get("command"), "%s: sets command (the image's entrypoint is not assumed)" % where)
            for argv in argvs(cont):
                cmds, assigns = simple_commands(argv)
                if kv_image:
                    a0 = argv[0]
                    c.ok(not a0.startswith("/") or a0 in INSTALLED or a0 in ("/bin/sh", "/bin/bash"),
                         "%s: %s is in the image (meson install under %s)" % (where, a0, IMAGE_PREFIX))
                for cmd in cmds:
                    prog = os.path.basename(cmd[0])
                    if cmd[0].startswith(IMAGE_PREFIX + "/") and kv_image:
                        c.ok(cmd[0] in INSTALLED, "%s: %s is installed by meson" % (where, cmd[0]))
                    if prog == "kvside-server":
                        opts, pos = parse_invocation(cmd, SERVER_OPTS, where)
                        c.ok(not pos, "%s: kvside-server takes no positional arguments: %s" % (where, pos))
                        servers.append((pod, spec, cont, cmd, opts, where))
                    elif prog == "kvside-ctl":
                        opts, pos = parse_invocation(cmd, CTL_OPTS, where)
                        c.ok(pos and pos[0] in CTL_CMDS, "%s: kvside-ctl command %s is one of %s" % (where, pos[:1], CTL_CMDS))
                        c.ok("--broker-dir" in opts, "%s: kvside-ctl names the broker directory" % where)
                        ctl_dirs.append((pod, spec, cont, opts.get("--broker-dir"), where))
                    elif prog in ("install", "chown") and kv_image:
                        preparers.append((pod, spec, cont, cmd, where))
                    elif prog == "cp" and kv_image:
                        args = [a for a in cmd[1:] if not a.startswith("-")]
                        for src in args[:-1]:
                            if src.startswith("$"):
                                var = src.strip("${}")
                                fcmd = assigns.get(var)
                                if c.ok(fcmd and fcmd[0] == "find" and "-path" in fcmd,
                                        "%s: %s comes from find ... -path" % (where, src)):
                                    froot, pat = fcmd[1], fcmd[fcmd.index("-path") + 1]
                                    hits = [p for p in INSTALLED_DIRS if p.startswith(froot + "/") and fnmatch.fnmatch(p, pat)]
                                    c.ok(hits, "%s: find %s -path %r finds a directory of the installed tree" % (where, froot, pat))
                                    for h in hits:
                                        if os.path.basename(h) == "kvside":
                                            copied_pkgs.append((where, h))
                            else:
                                c.ok(any(fnmatch.fnmatch(p, src) for p in INSTALLED),
                                     "%s: cp source %s is installed by meson" % (where, src))
            if any("--kv-transfer-config" in a for a in argvs(cont)):
                engines.append((pod, spec, cont, where))

    # the server, its configuration and probes
    server_eff = {}
    for pod, spec, cont, cmd, opts, where in servers:
        args = list(cmd[1:])
        tmpdir = tempfile.mkdtemp(prefix="kvt-k8s-")
        content = None
        if "--config" in opts:
            cpath = opts["--config"]
            m = mount_for(spec, cont, cpath)
            if c.ok(m and m[1] and "configMap" in m[1], "%s: --config %s is on a ConfigMap volume" % (where, cpath)):
                mount, vol, rel = m
                key = mount.get("subPath") or rel
                for it in vol["configMap"].get("items", []) or []:
                    if it["path"] == key:
                        key = it["key"]
                cm = configmaps.get(vol["configMap"]["name"])
                if c.ok(cm and key in (cm.get("data") or {}), "%s: ConfigMap %s has the key %s (same file)"
                        % (where, vol["configMap"]["name"], key)):
                    content = cm["data"][key]
            if content is not None:
                keys = set((yaml.safe_load(content) or {}).keys())
                c.ok(keys <= CONFIG_KEYS, "%s: config keys %s are keys of configs/kvside.yaml (unknown: %s)"
                     % (where, sorted(keys), sorted(keys - CONFIG_KEYS)))
                tmpcfg = os.path.join(tmpdir, "kvside.yaml")
                with open(tmpcfg, "w") as f:
                    f.write(content)
                args[args.index("--config") + 1] = tmpcfg
        p = subprocess.run([opscheck.SERVER] + args + ["--print-config"], capture_output=True, text=True, timeout=30)
        if c.ok(p.returncode == 0, "%s: kvside-server accepts the command line and file (%s)"
                % (where, (p.stderr.strip().splitlines() or [""])[0])):
            eff = yaml.safe_load(p.stdout)
        else:  # go on with what the file and the options say, to report the rest too
            eff = {"metrics-listen": "127.0.0.1:9464", "l1-size": "1G", "broker-dir": None}
            eff.update(yaml.safe_load(content or "") or {} if "--config" in opts else {})
            eff.update({k[2:]: v for k, v in opts.items() if k[2:] in eff or k[2:] in CONFIG_KEYS})
        if eff.get("broker-dir"):
            server_eff[(pod, cont["name"])] = eff
            broker = eff["broker-dir"]
            c.ok(os.path.isabs(broker), "%s: broker-dir %s is absolute" % (where, broker))
            m = mount_for(spec, cont, broker)
            c.ok(m and m[1] and not m[0].get("readOnly") and m[2] != ".",
                 "%s: broker-dir %s lies below a writable volume mount (the server creates it, owned by its UID)"
                 % (where, broker))
            host, _, port = str(eff["metrics-listen"]).rpartition(":")
            c.ok(host in ("0.0.0.0", "[::]", "::"), "%s: metrics-listen %s on all interfaces (probes reach the Pod IP)"
                 % (where, eff["metrics-listen"]))
            ports = {pt.get("name"): pt["containerPort"] for pt in cont.get("ports", [])}
            c.ok(ports.get("kvside-metrics") == int(port or -1), "%s: port kvside-metrics is metrics-listen's %s: %s"
                 % (where, port, ports))
            for probe, path_ in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
                pr = cont.get(probe)
                if probe == "startupProbe" and not pr:
                    continue
                hg = (pr or {}).get("httpGet") or {}
                c.ok(hg.get("path") == path_ and hg.get("port") in ("kvside-metrics", int(port or -1)),
                     "%s: %s is httpGet %s on the metrics port (%s)" % (where, probe, path_, hg))
            limit = k8s_bytes(((cont.get("resources") or {}).get("limits") or {}).get("memory", ""))
            c.ok(limit and limit > kvside_bytes(eff["l1-size"]), "%s: memory limit %s above l1-size %s"
                 % (where, (cont.get("resources") or {}).get("limits"), eff["l1-size"]))
            if sec(spec, cont, "readOnlyRootFilesystem"):
                if eff.get("l2-path"):
                    m = mount_for(spec, cont, eff["l2-path"])
                    c.ok(m and m[1] and not m[0].get("readOnly"),
                         "%s: l2-path %s on a writable volume (read-only root file system)" % (where, eff["l2-path"]))
            uid = sec(spec, cont, "runAsUser")
            c.ok(isinstance(uid, int) and uid > 0, "%s: runs as a non-root runAsUser (%s)" % (where, uid))
            if cont in spec.get("initContainers", []):
                c.ok(cont.get("restartPolicy") == "Always", "%s: an init container only as a native sidecar "
                     "(restartPolicy: Always)" % where)
        shutil.rmtree(tmpdir, ignore_errors=True)

    c.ok(len(server_eff) == 1, "%s: one kvside-server (%d)" % (fname, len(server_eff)))
    if not server_eff:
        continue
    (spod, sname), eff = next(iter(server_eff.items()))
    spod_, sspec, scont = [(p, s, x) for p, s, x, *_ in servers if p == spod and x["name"] == sname][0]
    broker = eff["broker-dir"]
    sstore = storage_of(spod, sspec, scont, broker)
    suid, sgid = sec(sspec, scont, "runAsUser"), sec(sspec, scont, "runAsGroup")

    for pod, spec, cont, d_, where in ctl_dirs:
        c.ok(d_ == broker, "%s: kvside-ctl --broker-dir %s is the server's %s" % (where, d_, broker))
        c.ok(storage_of(pod, spec, cont, d_) == sstore, "%s: kvside-ctl sees the server's broker directory" % where)
        c.ok(sec(spec, cont, "runAsUser") == suid, "%s: kvside-ctl runs as the server's UID" % where)

    for pod, spec, cont, cmd, where in preparers:
        if sec(spec, cont, "runAsUser") != 0:
            continue
        owner = None
        if os.path.basename(cmd[0]) == "install" and "-o" in cmd:
            owner = (cmd[cmd.index("-o") + 1], cmd[cmd.index("-g") + 1] if "-g" in cmd else None)
            dirs = [a for i, a in enumerate(cmd[1:], 1) if a.startswith("/") and cmd[i - 1] not in ("-o", "-g", "-m")]
        else:
            owner = tuple(cmd[[i for i, a in enumerate(cmd) if i and not a.startswith("-")][0]].split(":") + [None])[:2]
            dirs = [a for a in cmd[2:] if a.startswith("/")]
        c.ok(owner[0] == str(suid) and owner[1] in (None, str(sgid)),
             "%s: gives the directories to the server's UID:GID %s:%s (%s)" % (where, suid, sgid, owner))
        stores = [storage_of(pod, spec, cont, x) for x in dirs]
        c.ok(sstore in stores, "%s: prepares the server's broker directory %s" % (where, broker))

    c.ok(engines, "%s: a vLLM container using the connector" % fname)
    fields = connector_fields()
    for pod, spec, cont, where in engines:
        argv = argvs(cont)[0]
        try:
            ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        except (ValueError, IndexError) as e:
            c.fail("%s: --kv-transfer-config is JSON: %s" % (where, e))
            continue
        mod = ktc.get("kv_connector_module_path", "")
        connector_modules.add(mod)
        pkg = os.path.join(ROOT, "worker", "python", *mod.split("."))
        init = os.path.join(pkg, "__init__.py") if os.path.isdir(pkg) else pkg + ".py"
        if c.ok(mod.startswith("kvside.") and os.path.exists(init), "%s: module %s is in worker/python" % (where, mod)):
            c.ok(re.search(r'\b%s\b' % re.escape(ktc.get("kv_connector", "?")), open(init).read()),
                 "%s: %s exports %s" % (where, mod, ktc.get("kv_connector")))
        c.ok(ktc.get("kv_role") in ("kv_both", "kv_producer", "kv_consumer"), "%s: kv_role" % where)
        c.ok(ktc.get("kv_load_failure_policy") == "recompute", "%s: kv_load_failure_policy recompute (docs/vllm.md)" % where)
        extra = ktc.get("kv_connector_extra_config", {})
        for k, v in extra.items():
            if c.ok(k in fields, "%s: extra config key %s is a ConnectorConfig field" % (where, k)):
                t = fields[k][0] or {"str": str, "int": int, "bool": bool}.get(fields[k][1])
                c.ok(t is None or (isinstance(v, t) and not (t is int and isinstance(v, bool))),
                     "%s: extra config %s=%r has the field's type" % (where, k, v))
        edir = extra.get("broker_dir")
        c.ok(edir == broker, "%s: the connector's broker_dir %s is the server's %s" % (where, edir, broker))
        if edir:
            m = mount_for(spec, cont, edir)
            c.ok(storage_of(pod, spec, cont, edir) == sstore,
                 "%s: the broker directory is the server's volume (%s vs %s)" % (where, storage_of(pod, spec, cont, edir), sstore))
        c.ok(sec(spec, cont, "runAsUser") == suid and suid is not None and
             sec(spec, cont, "runAsGroup") == sgid, "%s: runs as the server's UID:GID %s:%s" % (where, suid, sgid))
        same_pod = pod == spod
        if same_pod:
            shm = [storage_of(pod, spec, x, "/dev/shm") for x in (scont, cont)]
            if any(shm):
                vol = mount_for(spec, cont, "/dev/shm")
                c.ok(shm[0] == shm[1] and vol and vol[1] and (vol[1].get("emptyDir") or {}).get("medium") == "Memory",
                     "%s: /dev/shm is one Memory emptyDir in both containers" % where)
        else:
            c.ok(spec.get("hostIPC") and sspec.get("hostIPC"), "%s: hostIPC on the engine and the server Pods "
                 "(CUDA IPC across Pods)" % where)
            c.ok(not storage_of(pod, spec, cont, "/dev/shm") and not storage_of(spod, sspec, scont, "/dev/shm"),
                 "%s: /dev/shm is the host's in both (no volume over it)" % where)
        env = {e["name"]: e.get("value") for e in cont.get("env", [])}
        c.ok(re.fullmatch(r"\d+", env.get("PYTHONHASHSEED") or ""), "%s: PYTHONHASHSEED set (docs/vllm.md)" % where)
        # PYTHONPATH / KVSIDE_LIB: copied there by a kvside-image init container
        copies = []
        for kind, ic in all_containers(spec):
            if kind == "init" and is_kvside_image(ic.get("image")):
                for a in argvs(ic):
                    for cmd in simple_commands(a)[0]:
                        if os.path.basename(cmd[0]) == "cp":
                            args = [x for x in cmd[1:] if not x.startswith("-")]
                            copies.append((storage_of(pod, spec, ic, args[-1].rstrip("/")), args[:-1]))
        lib = env.get("KVSIDE_LIB")
        if c.ok(lib, "%s: KVSIDE_LIB set" % where):
            c.ok(any(dst == storage_of(pod, spec, cont, lib) and any("libkvside" in s for s in srcs)
                     for dst, srcs in copies), "%s: KVSIDE_LIB %s is the library an init container copied" % (where, lib))
        pp = env.get("PYTHONPATH")
        if c.ok(pp, "%s: PYTHONPATH set" % where):
            c.ok(any(dst == storage_of(pod, spec, cont, pp.split(":")[0]) for dst, _ in copies),
                 "%s: PYTHONPATH %s is where an init container copied the kvside package" % (where, pp))

# the package the init containers copy holds the connector module vLLM loads
for where, h in copied_pkgs:
    for mod in connector_modules:
        rel = mod.split(".")[1:]
        c.ok(os.path.join(h, *rel, "__init__.py") in INSTALLED or os.path.join(h, *rel) + ".py" in INSTALLED,
             "%s: the copied package %s holds %s (meson install of worker/python)" % (where, h, mod))
c.ok(copied_pkgs and connector_modules, "an init container copies the kvside package; vLLM loads a module of it")
c.ok({"Pod", "DaemonSet", "ConfigMap"} <= kinds_seen, "the manifests have a Pod, a DaemonSet and ConfigMaps")
c.done()
