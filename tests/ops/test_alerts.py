#!/usr/bin/python3
"""The alert rules and the example Prometheus configuration, checked with
Debian's promtool (package prometheus):

  * `promtool check rules configs/prometheus/kvside-alerts.yml`;
  * `promtool test rules tests/ops/kvside-alerts.test.yml`: a healthy, busy
    server raises no alert, and each alert fires on the series it is meant
    for (with its labels and rendered annotations) and not before;
  * `promtool check config configs/prometheus/prometheus.yml` (which loads
    the rule file too);
  * without promtool: every alert has a severity of critical/warning/info, a
    summary and a description, a unique name, and a firing case plus a
    quiet case in the unit-test file.

That the metric names exist is tests/ops/test_live.py's part. Exit 77 (skip)
only when promtool is not installed, after the checks that need no promtool.
"""

import os
import subprocess

import yaml

import opscheck

c = opscheck.Checks("alerts")

with open(opscheck.RULES) as f:
    rules_doc = yaml.safe_load(f)
alerts = [r for g in rules_doc["groups"] for r in g["rules"] if "alert" in r]
names = [a["alert"] for a in alerts]
c.ok(len(names) == len(set(names)), "alert names are unique: %s" % names)
for a in alerts:
    n = a["alert"]
    c.ok(a.get("labels", {}).get("severity") in ("critical", "warning", "info"),
         "%s: severity label critical/warning/info" % n)
    ann = a.get("annotations", {})
    c.ok(ann.get("summary") and ann.get("description"), "%s: summary and description annotations" % n)
    used = opscheck.metric_names(a["expr"])
    c.ok(used and all(m.startswith("kvside_") or m == "up" for m in used),
         "%s: selects kvside metrics (or up): %s" % (n, sorted(used)))

# the topics the rules must cover (issue 20): stalled loop, L2 write errors
# and drops, error-rate spikes, heartbeat reaping
need = {"kvside_main_loop_tick_age_seconds", "kvside_l2_write_errors_total",
        "kvside_l2_write_drops_total", "kvside_errors_total", "kvside_sessions_reaped_total"}
covered = set().union(*(opscheck.metric_names(a["expr"]) for a in alerts))
c.ok(need <= covered, "rules cover %s (missing %s)" % (sorted(need), sorted(need - covered)))

with open(opscheck.RULE_TESTS) as f:
    tests = yaml.safe_load(f)
fires, quiet = set(), set()
for t in tests["tests"]:
    for art in t.get("alert_rule_test", []):
        (fires if art.get("exp_alerts") else quiet).add(art["alertname"])
for n in names:
    c.ok(n in fires, "%s: the unit tests make it fire" % n)
    c.ok(n in quiet, "%s: the unit tests check it quiet" % n)
healthy = [t for t in tests["tests"] if t.get("name") == "healthy"]
c.ok(healthy and {a["alertname"] for a in healthy[0]["alert_rule_test"]} == set(names),
     "the 'healthy' unit test checks every alert quiet")

tool = opscheck.promtool()
if not tool:
    c.done(skip_reason="promtool not installed (apt-get install prometheus)")


def run(args, cwd=None):
    p = subprocess.run([tool] + args, cwd=cwd, capture_output=True, text=True, timeout=120)
    print("$ promtool %s\n%s%s" % (" ".join(args), p.stdout, p.stderr), flush=True)
    return p


p = run(["check", "rules", opscheck.RULES])
n_rules = sum(len(g["rules"]) for g in rules_doc["groups"])
c.ok(p.returncode == 0 and "SUCCESS: %d rules found" % n_rules in p.stdout,
     "promtool check rules kvside-alerts.yml")
p = run(["test", "rules", os.path.basename(opscheck.RULE_TESTS)], cwd=os.path.dirname(opscheck.RULE_TESTS))
c.ok(p.returncode == 0 and "SUCCESS" in p.stdout + p.stderr, "promtool test rules kvside-alerts.test.yml")
p = run(["check", "config", opscheck.PROM_CONFIG])
c.ok(p.returncode == 0 and "WARNING" not in p.stdout + p.stderr, "promtool check config prometheus.yml")
c.done()
