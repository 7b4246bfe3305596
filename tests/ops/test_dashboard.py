#!/usr/bin/python3
"""The Grafana dashboard configs/grafana/kvside.json, without Grafana:

  * valid JSON with what Grafana needs to import it: title, uid, an integer
    schemaVersion, time range, templating, panels;
  * panels: unique integer ids, a known type, a title, a grid position inside
    the 24-column grid that overlaps no other panel; every data panel reads
    the `datasource` variable (a Prometheus data-source variable) and has
    targets with distinct refIds and a PromQL expression;
  * every kvside selector is filtered by the dashboard's $job and $instance
    variables, and every variable a query uses is defined;
  * the panels the issue asks for are there: hit ratio by tier, GB/s by
    direction, job latency, L1 and L2 use, L2 queue depth and drops, errors by
    code, sessions;
  * every expression (Grafana's variables replaced as Grafana would) and the
    selectors of the variable queries parse as PromQL: they are fed to
    `promtool check rules` as recording rules.

That the metric names exist and that every query evaluates against a live
server is tests/ops/test_live.py's part. Exit 77 (skip) only when promtool is
not installed, after the checks that need no promtool.
"""

import os
import re
import subprocess
import tempfile

import opscheck

c = opscheck.Checks("dashboard")

try:
    dash = opscheck.load_dashboard()
except ValueError as e:
    c.fail("kvside.json is not valid JSON: %s" % e)
    c.done()

for key, typ in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                 ("templating", dict), ("time", dict), ("tags", list)):
    c.ok(isinstance(dash.get(key), typ), "dashboard has %s (%s)" % (key, typ.__name__))
c.ok(dash.get("schemaVersion", 0) >= 36, "schemaVersion %s is a current one (>= 36)" % dash.get("schemaVersion"))
c.ok(dash.get("id") is None, "no fixed dashboard id (Grafana assigns one at import)")
c.ok(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dash.get("uid", "")), "uid is a valid Grafana uid")

variables = {v["name"]: v for v in dash["templating"].get("list", [])}
ds = variables.get("datasource", {})
c.ok(ds.get("type") == "datasource" and ds.get("query") == "prometheus",
     "a 'datasource' variable of Prometheus data sources")
DS = {"type": "prometheus", "uid": "${datasource}"}
for name in ("job", "instance"):
    v = variables.get(name, {})
    c.ok(v.get("type") == "query" and v.get("datasource") == DS and "kvside_" in str(v.get("query")),
         "a '%s' query variable over kvside's metrics" % name)

TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap", "piechart"}
panels = list(opscheck.dashboard_panels(dash))
ids = [p.get("id") for p in panels]
c.ok(all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids are unique integers")
rects = []
for p in panels:
    t = p.get("title", "?")
    c.ok(p.get("type") in TYPES, "panel %r: known type %r" % (t, p.get("type")))
    c.ok(bool(p.get("title")), "panel %s has a title" % p.get("id"))
    g = p.get("gridPos", {})
    good = all(isinstance(g.get(k), int) for k in "hwxy") and g["x"] >= 0 and g["w"] > 0 \
        and g["x"] + g["w"] <= 24 and g["h"] > 0 and g["y"] >= 0
    if c.ok(good, "panel %r: gridPos inside the 24-column grid: %s" % (t, g)):
        for (t2, g2) in rects:
            overlap = g["x"] < g2["x"] + g2["w"] and g2["x"] < g["x"] + g["w"] \
                and g["y"] < g2["y"] + g2["h"] and g2["y"] < g["y"] + g["h"]
            c.ok(not overlap, "panels %r and %r do not overlap" % (t, t2))
        rects.append((t, g))
    if p.get("type") in ("row", "text"):
        continue
    c.ok(p.get("datasource") == DS, "panel %r reads the datasource variable" % t)
    targets = p.get("targets") or []
    c.ok(targets, "panel %r has targets" % t)
    refs = [x.get("refId") for x in targets]
    c.ok(len(refs) == len(set(refs)) and all(refs), "panel %r: distinct refIds" % t)
    for x in targets:
        c.ok(x.get("datasource") in (None, DS), "panel %r %s: datasource variable" % (t, x.get("refId")))
        c.ok(isinstance(x.get("expr"), str) and x["expr"].strip(), "panel %r %s: a PromQL expr" % (t, x.get("refId")))

targets = opscheck.dashboard_targets(dash)
for title, ref, expr, legend in targets:
    for name, matchers in opscheck.selectors(expr):
        if name and name.startswith("kvside_"):
            labels = {(a, op, v) for a, op, v in matchers}
            c.ok(("job", "=~", "$job") in labels and ("instance", "=~", "$instance") in labels,
                 "panel %r %s: %s filtered by job=~\"$job\" and instance=~\"$instance\"" % (title, ref, name))
    for var in re.findall(r'\$\{?(\w+)\}?', expr):
        c.ok(var.startswith("__") or var in variables, "panel %r %s: variable $%s defined" % (title, ref, var))


def panel_uses(title_re, metric, by=None):
    for title, ref, expr, legend in targets:
        if re.search(title_re, title, re.I) and metric in opscheck.metric_names(expr) \
                and (by is None or by in opscheck.grouping_labels(expr)):
            return True
    return False


for what, title_re, metric, by in (
        ("hit ratio by tier", r"hit ratio", "kvside_lookup_hits_total", "tier"),
        ("GB/s by direction", r"GB/s", "kvside_copy_direction_bytes_total", "direction"),
        ("job latency", r"latency", "kvside_jobs_finished_total", None),
        ("L1 use", r"L1", "kvside_l1_used_bytes", None),
        ("L2 use", r"L2", "kvside_l2_used_bytes", None),
        ("L2 queue depth", r"queue", "kvside_l2_queue_depth", None),
        ("L2 write drops", r"drops", "kvside_l2_write_drops_total", None),
        ("errors by code", r"errors", "kvside_errors_total", "code"),
        ("sessions", r"sessions", "kvside_sessions", None)):
    c.ok(panel_uses(title_re, metric, by), "a panel shows %s (%s%s)" % (what, metric, " by " + by if by else ""))

tool = opscheck.promtool()
if not tool:
    c.done(skip_reason="promtool not installed (apt-get install prometheus)")

# every expression as a recording rule: promtool parses each one
exprs = [("%s %s" % (t, r), opscheck.grafana_expand(e)) for t, r, e, _ in targets]
for name, v in variables.items():
    q = str(v.get("query", ""))
    m = re.fullmatch(r'\s*label_values\((.*),\s*(\w+)\)\s*', q)
    if v.get("type") == "query":
        c.ok(m, "variable %s: label_values(selector, label)" % name)
        if m:
            exprs.append(("variable " + name, opscheck.grafana_expand(m.group(1))))
rules = ["groups:", "  - name: dashboard", "    rules:"]
for i, (_, e) in enumerate(exprs):
    rules += ["      - record: dashboard:expr_%d" % i, "        expr: |"] + \
             ["          " + line for line in e.splitlines()]
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "dashboard-exprs.yml")
    with open(path, "w") as f:
        f.write("\n".join(rules) + "\n")
    p = subprocess.run([tool, "check", "rules", path], capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    print(out)
    c.ok(p.returncode == 0 and "SUCCESS: %d rules found" % len(exprs) in out,
         "promtool parses all %d dashboard expressions" % len(exprs))
    if p.returncode:
        for i, (where, e) in enumerate(exprs):
            if '"dashboard:expr_%d"' % i in out:
                print("  expr_%d = %s: %s" % (i, where, e))
c.done()
