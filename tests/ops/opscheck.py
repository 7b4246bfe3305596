"""Shared helpers of the operations tests (tests/ops): where things are, a
failure collector, the Prometheus text format and PromQL pulled apart far
enough to name the metrics and labels an expression uses, and the rules and
dashboard read into (name, expression) pairs.

Environment (set by tests/ops/meson.build): KVS_SOURCE_ROOT, KVS_BUILD_ROOT,
KVS_SERVER, KVS_CTL; KVSIDE_LIB and PYTHONPATH for the live test.
"""

import json
import os
import re
import shutil
import sys

ROOT = os.environ.get("KVS_SOURCE_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KVS_BUILD_ROOT", os.path.join(ROOT, "build"))
SERVER = os.environ.get("KVS_SERVER", os.path.join(BUILD, "server", "kvside-server"))
CTL = os.environ.get("KVS_CTL", os.path.join(BUILD, "worker", "kvside-ctl"))
RULES = os.path.join(ROOT, "configs", "prometheus", "kvside-alerts.yml")
PROM_CONFIG = os.path.join(ROOT, "configs", "prometheus", "prometheus.yml")
DASHBOARD = os.path.join(ROOT, "configs", "grafana", "kvside.json")
RULE_TESTS = os.path.join(ROOT, "tests", "ops", "kvside-alerts.test.yml")
K8S_DIR = os.path.join(ROOT, "configs", "k8s")

SKIP = 77


def promtool():
    return shutil.which("promtool")


class Checks:
    """Collects failures so that one run reports all of them."""

    def __init__(self, name):
        self.name = name
        self.failures = []
        self.passed = 0

    def ok(self, cond, what):
        if cond:
            self.passed += 1
        else:
            self.failures.append(what)
            print("FAIL: %s" % what, flush=True)
        return cond

    def fail(self, what):
        return self.ok(False, what)

    def done(self, skip_reason=None):
        print("%s: %d checks passed, %d failed" % (self.name, self.passed, len(self.failures)))
        if self.failures:
            sys.exit(1)
        if skip_reason:
            print("SKIP: %s" % skip_reason)
            sys.exit(SKIP)
        sys.exit(0)


# ---- the Prometheus text format -----------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def parse_exposition(text):
    """{metric name: {"type": str or None, "labels": {label: set(values)}, "samples": n}}"""
    fams = {}

    def fam(name):
        return fams.setdefault(name, {"type": None, "labels": {}, "samples": 0})

    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(None, 3)
            fam(name)["type"] = typ.strip()
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError("unparsable sample line: %r" % line)
        f = fam(m.group(1))
        f["samples"] += 1
        for lm in _LABEL.finditer(m.group(3) or ""):
            f["labels"].setdefault(lm.group(1), set()).add(lm.group(2))
    return fams


HIST_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def resolve_metric(name, fams):
    """The family a name used in PromQL refers to: itself, or a histogram or
    summary family of which it is a documented suffix (_bucket, _sum,
    _count). None if neither."""
    if name in fams:
        return name
    for typ, suffixes in HIST_SUFFIXES.items():
        for s in suffixes:
            if name.endswith(s) and fams.get(name[:-len(s)], {}).get("type") == typ:
                return name[:-len(s)]
    return None


# ---- PromQL, far enough to name metrics and labels ----------------------------------

_STR = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan", "atan2", "start", "end"}
_GROUPING = re.compile(r'\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)')
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_SELECTOR = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}')
_IDENT = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*')


def metric_names(expr):
    """Metric names an expression selects (functions, keywords, label names
    and numbers left out)."""
    e = _STR.sub('""', expr)
    e = re.sub(r'\{[^}]*\}', ' ', e)
    e = re.sub(r'\[[^\]]*\]', ' ', e)
    e = re.sub(r'\boffset\s+-?[0-9a-z]+', ' ', e)
    e = _GROUPING.sub(' ', e)
    e = re.sub(r'(?<![a-zA-Z_:0-9])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?', ' ', e)
    names = set()
    for m in _IDENT.finditer(e):
        rest = e[m.end():]
        if re.match(r'\s*\(', rest):
            continue  # a function or an aggregation
        if m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def selectors(expr):
    """[(metric name or None, [(label, op, value)])] of every {...} selector."""
    out = []
    for m in _SELECTOR.finditer(expr):
        out.append((m.group(1), [(a, op, v) for a, op, v in _MATCHER.findall(m.group(2))]))
    return out


def grouping_labels(expr):
    """Label names of by/without/on/ignoring/group_* clauses."""
    labels = set()
    for _, inner in _GROUPING.findall(_STR.sub('""', expr)):
        labels.update(x.strip() for x in inner.split(",") if x.strip())
    return labels


# ---- the files under test -----------------------------------------------------------

def load_rules():
    import yaml
    with open(RULES) as f:
        doc = yaml.safe_load(f)
    out = []
    for g in doc["groups"]:
        for r in g["rules"]:
            out.append((r.get("alert") or r.get("record"), r["expr"]))
    return out


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_panels(dash):
    """Every panel, rows' nested panels included."""
    for p in dash.get("panels", []):
        yield p
        for q in p.get("panels", []) or []:
            yield q


def dashboard_targets(dash):
    """[(panel title, refId, expr, legendFormat)] of every Prometheus target."""
    out = []
    for p in dashboard_panels(dash):
        for t in p.get("targets", []) or []:
            if "expr" in t:
                out.append((p.get("title", "?"), t.get("refId", "?"), t["expr"], t.get("legendFormat", "")))
    return out


# Grafana's variables, as a query would reach Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def grafana_expand(expr, values=None):
    """The expression with Grafana's variables replaced: the built-in
    intervals by durations, dashboard variables ($job, ${job}) by `values`
    or by `.*` (every use is a regex match)."""
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    values = values or {}

    def var(m):
        name = m.group(1) or m.group(2)
        return values.get(name, ".*")

    return re.sub(r'\$\{(\w+)\}|\$(\w+)', var, expr)
