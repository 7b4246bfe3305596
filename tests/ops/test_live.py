#!/usr/bin/python3
"""kvside's metrics as Prometheus, the dashboard and the alert rules see them,
against a live server:

  1. starts kvside-server with an L2 tier and its metrics endpoint on a free
     port (--metrics-listen 127.0.0.1:0; the port from `kvside-ctl --json
     stats`, counter metrics_port) and drives real traffic through the Python
     binding: a worker rank storing, retrieving and (once in a while)
     retrieving a key never stored (E_MISS), a scheduler looking up; L1 is
     small, so objects are evicted and L2 hits are promoted;
  2. /healthz and /readyz answer 200; after `kvside-ctl drain` /readyz answers
     503 (draining) while /healthz stays 200; `resume` turns it back;
  3. its /metrics is fed to `promtool check metrics` (format and lint; the
     only problems tolerated are lint notes on the untyped kvside_stat_*
     fallback series, whose names come from the server's internal counters);
  4. every metric name used by the dashboard (targets and variable queries)
     and by the alert rules is in that scrape (or is a histogram/summary
     suffix of a family in it), `up` aside; CUDA-only series of a build
     without the CUDA engine are looked up in server/ops.c instead; every
     label matcher names a label the metric has, with a value it takes
     (error codes: a code of common/kvs_error.c), and every by/on/ignoring
     label is carried by a metric of the expression;
  5. a real Prometheus (Debian's, package prometheus) scrapes the server
     every second with the alert rules loaded: every dashboard query
     evaluates without error and returns series, with the labels its legend
     names; the hit ratio shows L1 hits, GB/s shows both directions, errors
     by code shows E_MISS; every rule evaluates without error and none fires.

Exit 77 (skip) only when promtool/prometheus are not installed, after the
checks that need neither.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import kvside

import opscheck

c = opscheck.Checks("live")
NS = "ops-model"
TPB, BPC, LAYERS, BLOCKS, BLOCK_BYTES = 16, 4, 2, 64, 16384
CHUNK = TPB * BPC
REGION = LAYERS * BLOCKS * BLOCK_BYTES
N = 4  # chunks per job


def http_get(port, path, timeout=5):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def ctl(run, *args):
    p = subprocess.run([opscheck.CTL, "--broker-dir", run, "--json"] + list(args),
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout


class Traffic(threading.Thread):
    """One worker rank and a scheduler: store a new prompt, look it up,
    retrieve it into other blocks, look up an old prompt (evicted from L1:
    an L2 hit, promoted by the retrieve), and every 8th round retrieve a key
    never stored (E_MISS)."""

    def __init__(self, run):
        super().__init__(daemon=True)
        self.run_dir = run
        self.stop = threading.Event()
        self.rounds = 0
        self.errors = []
        self.misses = 0

    def run(self):
        try:
            self.loop()
        except Exception as e:  # reported by the main thread
            self.errors.append(repr(e))

    def loop(self):
        mem = kvside.HostMemory(REGION, name="kvt-ops")
        mem.view[:] = os.urandom(REGION)
        w = kvside.Client("ops-eng", NS, role="worker", rank=0, world=1, broker_dir=self.run_dir,
                          timeout_ms=5000)
        s = kvside.Client("ops-eng", NS, role="scheduler", world=1, broker_dir=self.run_dir,
                          timeout_ms=5000)
        w.register_memory([mem], groups=[kvside.Group(0, "attention", TPB, BPC)],
                          layers=[kvside.Layer(0, 0, l * BLOCKS * BLOCK_BYTES, BLOCKS, BLOCK_BYTES,
                                               BLOCK_BYTES) for l in range(LAYERS)])
        src = [[i for i in range(N * BPC)]]
        dst = [[32 + i for i in range(N * BPC)]]
        job = 0
        while not self.stop.is_set():
            r = self.rounds
            keys = kvside.chunk_keys(NS, [7 + r * 100003 + t for t in range(N * CHUNK)], CHUNK)
            job += 1
            w.store(job, keys, src)
            w.complete(job)
            s.job_wait(job, 5000)
            s.lookup(keys)
            job += 1
            w.retrieve(job, keys, dst)
            w.complete(job)
            s.job_wait(job, 5000)
            if r >= 40:
                old = kvside.chunk_keys(NS, [7 + (r - 40) * 100003 + t for t in range(N * CHUNK)], CHUNK)
                s.lookup(old, prefetch=True)
                job += 1
                try:
                    w.retrieve(job, old, dst)
                    w.complete(job)
                    s.job_wait(job, 5000)
                except kvside.KvsideError:
                    pass
            if r % 8 == 7:
                job += 1
                try:
                    w.retrieve(job, kvside.chunk_keys(NS, [1, 2, 3] * CHUNK, CHUNK)[:1], [dst[0][:BPC]])
                except kvside.KvsideError as e:
                    if e.code_name == "E_MISS":
                        self.misses += 1
                    else:
                        raise
            self.rounds += 1
            time.sleep(0.01)
        w.close()
        s.close()
        mem.close()


def cuda_counters():
    """Counter names server/ops.c exports under #if KVS_HAVE_CUDA."""
    with open(os.path.join(opscheck.ROOT, "server", "ops.c")) as f:
        return set(re.findall(r'C\("(cuda_[a-z0-9_]+)"', f.read()))


def error_codes():
    with open(os.path.join(opscheck.ROOT, "common", "kvs_error.c")) as f:
        return set(re.findall(r'\{"(E_[A-Z_]+)"', f.read()))


def check_names(fams, where, expr, cuda_build):
    """Metric names, label matchers and grouping labels of one expression
    against the scrape."""
    used = opscheck.metric_names(expr)
    c.ok(used, "%s: selects some metric" % where)
    families = []
    for name in sorted(used):
        if name == "up":
            continue
        fam = opscheck.resolve_metric(name, fams)
        if fam is None and not cuda_build and re.match(r'kvside_(stat_)?cuda_', name):
            base = re.sub(r'^kvside_(stat_)?', '', name)
            base = re.sub(r'_total$', '', base) if not name.startswith("kvside_stat_") else base
            c.ok(base in cuda_counters() or base + "s" in cuda_counters(),
                 "%s: %s (CUDA-only; this build has no CUDA engine) is a counter of server/ops.c" % (where, name))
            continue
        if c.ok(fam is not None, "%s: metric %s is in the scrape" % (where, name)):
            families.append(fam)
    codes = error_codes()
    target_labels = {"job", "instance"}
    for name, matchers in opscheck.selectors(expr):
        fam = opscheck.resolve_metric(name, fams) if name else None
        if not fam:
            continue
        labels = fams[fam]["labels"]
        for label, op, value in matchers:
            if label in target_labels or value.startswith("$"):
                continue
            if fam == "kvside_errors_total" and label == "code":
                alts = value.split("|") if op in ("=~", "!~") else [value]
                c.ok(all(a in codes for a in alts), "%s: error codes %s exist" % (where, value))
                continue
            if fam == "kvside_errors_total" and label == "op" and label not in labels:
                continue
            if not c.ok(label in labels, "%s: %s has a label %s (has %s)" % (where, fam, label, sorted(labels))):
                continue
            if op == "=":
                c.ok(value in labels[label], "%s: %s{%s} takes the value %r (seen %s)"
                     % (where, fam, label, value, sorted(labels[label])))
            elif op == "=~":
                c.ok(any(re.fullmatch(value, v) for v in labels[label]),
                     "%s: %s{%s=~%r} matches a value (seen %s)" % (where, fam, label, value, sorted(labels[label])))
    carried = set(target_labels)
    for fam in families:
        carried |= set(fams[fam]["labels"])
    if "kvside_errors_total" in families:
        carried |= {"op", "code"}
    for label in opscheck.grouping_labels(expr):
        c.ok(label in carried, "%s: grouping label %s is carried by %s" % (where, label, families))


skip = None
tmp = tempfile.mkdtemp(prefix="kvt-ops-")
run = os.path.join(tmp, "run")
server = prom = traffic = None
server_log = open(os.path.join(tmp, "server.log"), "wb")
try:
    server = subprocess.Popen([opscheck.SERVER, "--broker-dir", run, "--metrics-listen", "127.0.0.1:0",
                               "--l1-size", "4M", "--l2-path", os.path.join(tmp, "l2"), "--l2-size", "64M",
                               "--l2-sync", "none", "--no-prefault", "--log-level", "warn"],
                              stdout=server_log, stderr=subprocess.STDOUT)
    port = 0
    deadline = time.time() + 20
    while time.time() < deadline and not port:
        if server.poll() is not None:
            break
        if os.path.exists(os.path.join(run, "kvside.zmq")):
            rc, out = ctl(run, "stats")
            if rc == 0:
                port = json.loads(out)["counters"]["metrics_port"]
        time.sleep(0.05)
    if not c.ok(port > 0, "the server started and reports its metrics port (%s)" % port):
        c.done()
    print("metrics on 127.0.0.1:%d" % port, flush=True)

    st, body = http_get(port, "/healthz")
    c.ok(st == 200 and body == "ok\n", "/healthz: 200 ok (%s %r)" % (st, body))
    st, body = http_get(port, "/readyz")
    c.ok(st == 200 and body == "ok\n", "/readyz: 200 ok (%s %r)" % (st, body))
    rc, _ = ctl(run, "drain", "--wait", "0")
    c.ok(rc == 0, "kvside-ctl drain")
    time.sleep(0.2)
    st, body = http_get(port, "/readyz")
    c.ok(st == 503 and "draining" in body, "/readyz while draining: 503 draining (%s %r)" % (st, body))
    st, _ = http_get(port, "/healthz")
    c.ok(st == 200, "/healthz while draining: 200 (%s)" % st)
    fams = opscheck.parse_exposition(http_get(port, "/metrics")[1])
    c.ok(fams.get("kvside_draining", {}).get("samples") == 1, "kvside_draining is exported")
    rc, _ = ctl(run, "resume")
    time.sleep(0.2)
    st, _ = http_get(port, "/readyz")
    c.ok(rc == 0 and st == 200, "/readyz after resume: 200 (%s)" % st)

    traffic = Traffic(run)
    traffic.start()

    # a real Prometheus scraping the server every second, with the rules
    prom_bin = shutil.which("prometheus")
    tool = opscheck.promtool()
    ppath = os.path.join(tmp, "prometheus.yml")
    prom_port = free_port()
    if prom_bin:
        with open(ppath, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "rule_files:\n  - %s\n"
                    "scrape_configs:\n  - job_name: kvside\n    static_configs:\n"
                    "      - targets: ['127.0.0.1:%d']\n" % (json.dumps(opscheck.RULES), port))
        prom = subprocess.Popen([prom_bin, "--config.file=" + ppath,
                                 "--storage.tsdb.path=" + os.path.join(tmp, "tsdb"),
                                 "--web.listen-address=127.0.0.1:%d" % prom_port, "--log.level=warn"],
                                stdout=open(os.path.join(tmp, "prometheus.log"), "wb"),
                                stderr=subprocess.STDOUT)

    # traffic for a while: enough rounds to evict and hit L2
    deadline = time.time() + 30
    while time.time() < deadline and traffic.rounds < 60 and not traffic.errors:
        time.sleep(0.1)
    c.ok(not traffic.errors, "traffic ran without errors: %s" % traffic.errors)
    c.ok(traffic.rounds >= 60 and traffic.misses > 0,
         "traffic: %d rounds, %d E_MISS retrieves" % (traffic.rounds, traffic.misses))

    print("traffic: %d rounds, %d E_MISS retrieves" % (traffic.rounds, traffic.misses), flush=True)
    text = http_get(port, "/metrics")[1]
    with open(os.path.join(tmp, "scrape.txt"), "w") as f:
        f.write(text)
    fams = opscheck.parse_exposition(text)
    for name, cond in (("kvside_lookup_hits_total", lambda f: f["samples"] == 3),
                       ("kvside_errors_total", lambda f: "E_MISS" in f["labels"].get("code", ())),
                       ("kvside_evictions_total", lambda f: f["samples"] == 2),
                       ("kvside_copy_direction_bytes_total", lambda f: f["samples"] >= 2)):
        c.ok(name in fams and cond(fams[name]), "the scrape has %s as expected: %s" % (name, fams.get(name)))
    vals = {}
    for line in text.splitlines():
        m = re.match(r'^(kvside_[a-z0-9_]+(?:\{[^}]*\})?) (\S+)$', line)
        if m:
            vals[m.group(1)] = float(m.group(2))
    c.ok(vals.get('kvside_lookup_hits_total{tier="l1"}', 0) > 0, "the traffic made L1 hits")
    c.ok(vals.get('kvside_evictions_total{tier="l1"}', 0) > 0, "the traffic made L1 evictions")
    c.ok(vals.get("kvside_l2_writes_committed_total", 0) > 0, "the traffic wrote to L2")
    c.ok(vals.get('kvside_lookup_hits_total{tier="l2"}', 0) > 0, "the traffic made L2 hits")

    # 3: promtool check metrics
    if tool:
        p = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        problems = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
        tolerated = [l for l in problems if l.startswith("kvside_stat_")]
        for l in tolerated:
            print("note (fallback series, named by the server's counter): %s" % l)
        c.ok(p.returncode in (0, 3) and len(tolerated) == len(problems),
             "promtool check metrics: rc %d, problems %s" % (p.returncode, [l for l in problems if l not in tolerated]))

    # 4: names and labels used by the dashboard and the rules
    cuda_build = "kvside_cuda_tasks_total" in fams
    dash = opscheck.load_dashboard()
    for title, ref, expr, _ in opscheck.dashboard_targets(dash):
        check_names(fams, "dashboard %r %s" % (title, ref), opscheck.grafana_expand(expr), cuda_build)
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            m = re.fullmatch(r'\s*label_values\((.*),\s*(\w+)\)\s*', str(v["query"]))
            if c.ok(m, "dashboard variable %s: label_values(selector, label)" % v["name"]):
                check_names(fams, "dashboard variable %s" % v["name"], opscheck.grafana_expand(m.group(1)),
                            cuda_build)
    for name, expr in opscheck.load_rules():
        check_names(fams, "rule %s" % name, expr, cuda_build)

    # 5: the queries and the rules in a real Prometheus
    if prom:
        api = "http://127.0.0.1:%d/api/v1/" % prom_port

        def query(q):
            url = api + "query?" + urllib.parse.urlencode({"query": q})
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    return json.load(r)
            except urllib.error.HTTPError as e:
                return json.load(e)

        ready = False
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                r = query('count_over_time(up{job="kvside"}[1m])')
                res = r.get("data", {}).get("result", [])
                if res and float(res[0]["value"][1]) >= 8:
                    ready = True
                    break
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            if prom.poll() is not None:
                break
            time.sleep(0.5)
        if c.ok(ready, "Prometheus scraped the server 8 times"):
            r = query('up{job="kvside"}')
            c.ok(r["data"]["result"] and r["data"]["result"][0]["value"][1] == "1", "up{job=\"kvside\"} is 1")
            expect = {  # (panel title, legend value) -> a condition on the value
                ("Lookup hit ratio by tier", "l1"): lambda v: 0 < v <= 1,
                ("Copy GB/s by direction", "store (host)"): lambda v: v > 0,
                ("Copy GB/s by direction", "retrieve (host)"): lambda v: v > 0,
                ("Errors by code", "E_MISS"): lambda v: v > 0,
            }
            seen = set()
            for title, ref, expr, legend in opscheck.dashboard_targets(dash):
                q = opscheck.grafana_expand(expr, {"job": "kvside", "instance": ".*"}).replace("[1m]", "[10s]")
                r = query(q)
                where = "dashboard %r %s" % (title, ref)
                if not c.ok(r.get("status") == "success", "%s evaluates: %s" % (where, r.get("error"))):
                    continue
                result = r["data"]["result"]
                cuda_only = all(re.match(r'kvside_(stat_)?cuda_', m) for m in opscheck.metric_names(expr))
                if not (cuda_only and not cuda_build):
                    c.ok(result, "%s returns series: %s" % (where, q))
                for s in result:
                    for label in re.findall(r'\{\{\s*(\w+)\s*\}\}', legend):
                        c.ok(label in s["metric"], "%s: legend label %s in the result %s" % (where, label, s["metric"]))
                    name = re.sub(r'\{\{\s*(\w+)\s*\}\}', lambda m: s["metric"].get(m.group(1), "?"), legend)
                    if (title, name) in expect:
                        seen.add((title, name))
                        v = float(s["value"][1])
                        c.ok(expect[(title, name)](v), "%s %r = %g as expected" % (where, name, v))
            c.ok(seen == set(expect), "the dashboard shows %s (missing %s)" % (sorted(expect), sorted(set(expect) - seen)))
            for v in dash["templating"]["list"]:
                if v.get("type") == "query":
                    m = re.fullmatch(r'\s*label_values\((.*),\s*(\w+)\)\s*', str(v["query"]))
                    r = query(opscheck.grafana_expand(m.group(1), {"job": "kvside"}))
                    vals_ = {s["metric"].get(m.group(2)) for s in r.get("data", {}).get("result", [])}
                    c.ok(vals_ - {None}, "dashboard variable %s has values: %s" % (v["name"], vals_))
            time.sleep(2)  # at least one evaluation of every rule with data
            with urllib.request.urlopen(api + "rules", timeout=10) as resp:
                groups = json.load(resp)["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            c.ok(len(rules) == len(opscheck.load_rules()), "Prometheus loaded %d rules" % len(rules))
            for r in rules:
                c.ok(r.get("health") == "ok", "rule %s evaluates: %s %s" % (r["name"], r.get("health"), r.get("lastError")))
                c.ok(r.get("state", "inactive") != "firing", "rule %s does not fire on a healthy server (%s)"
                     % (r["name"], r.get("alerts")))
    if not tool or not prom_bin:
        skip = "promtool/prometheus not installed (apt-get install prometheus)"
finally:
    if traffic:
        traffic.stop.set()
        traffic.join(30)
    if prom and prom.poll() is None:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
    if server and server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            rc = "killed"
        c.ok(rc == 0, "the server stopped with status 0 on SIGTERM (%s)" % rc)
    server_log.close()
    if c.failures:
        with open(os.path.join(tmp, "server.log"), errors="replace") as f:
            print("--- server log ---\n" + f.read()[-4000:])
        plog = os.path.join(tmp, "prometheus.log")
        if os.path.exists(plog):
            with open(plog, errors="replace") as f:
                print("--- prometheus log ---\n" + f.read()[-4000:])
    shutil.rmtree(tmp, ignore_errors=True)
c.done(skip_reason=skip)
