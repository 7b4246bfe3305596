#!/usr/bin/python3
"""Refreshes the table of faults and bad inputs in docs/reliability.md.

Runs the chaos suite (meson test --suite chaos, each scenario appending its
numbers to the file named by KVT_CHAOS_RESULTS) and the older hostile-input
tests (integration tests badinput and persist: their output carries their
numbers), then rewrites the part of docs/reliability.md between the
reliability-table markers. Exits 1 if a test failed (the table still shows
it).

    tools/reliability-table.py                 # build/, runs both (~4 min on 2 cores)
    tools/reliability-table.py -C build-rel    # another build directory
    tools/reliability-table.py --no-run        # the table from the last run's files
                                               # (build/meson-logs/chaos-results.jsonl, hostile.json)
    tools/reliability-table.py --results FILE [--hostile-log FILE]   # from other runs' files
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "reliability.md")
BEGIN = "<!-- reliability-table: begin (tools/reliability-table.py rewrites this part) -->"
END = "<!-- reliability-table: end -->"
ORDER = ["map_full", "enospc", "swapped_records", "btree_corruption", "kill9", "slow_peers", "tcp_auth", "ranks",
         "late_copy", "restart_scale"]
NUMBERS = {name: i + 1 for i, name in enumerate(ORDER)}  # the scenario numbers of docs/reliability.md


def run(cmd, env=None):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    return rc, time.monotonic() - t0


def fmt_value(v):
    if isinstance(v, float):
        return "%g" % v
    if isinstance(v, dict):
        return "{" + ", ".join("%s: %s" % (k, fmt_value(x)) for k, x in v.items()) + "}"
    if isinstance(v, list):
        if v and all(isinstance(x, str) for x in v):
            return "; ".join(v)
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    return str(v)


def cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def chaos_rows(results_path):
    rows = {}
    if results_path and os.path.exists(results_path):
        with open(results_path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[r["scenario"]] = r  # the last run of a scenario wins
    out = []
    for name in ORDER + sorted(set(rows) - set(ORDER)):
        r = rows.get(name)
        if r is None:
            out.append(["%s. %s" % (NUMBERS.get(name, "-"), name), "-", "(no result: the scenario did not report)",
                        "-", "not run", "-"])
            continue
        nums = ", ".join("%s %s" % (k, fmt_value(v)) for k, v in r["numbers"].items())
        out.append(["%s. %s" % (NUMBERS.get(name, "-"), r["fault"]), r["load"] or "-", r["lost"], nums or "-",
                    r["result"], "%.0f s" % r["seconds"]])
    return out


def hostile_rows(log_path):
    tests = {}
    if log_path and os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                d = json.loads(line)
                tests[d["name"].split(" / ")[-1]] = d
    out = []
    b = tests.get("badinput")
    if b:
        text = b.get("stdout", "") + (b.get("stderr") or "")
        ok = len(re.findall(r"^ok \d+ - ", text, re.M))
        bad = len(re.findall(r"^not ok \d+ - ", text, re.M))
        broker = len(re.findall(r"^ok \d+ - broker: ", text, re.M))
        out.append(["tests/integration/test_badinput.py: hostile input over ZeroMQ (not msgpack, truncated, "
                    "wrong types and ranges, oversized messages and nesting, multipart, a burst of 3000 bad "
                    "requests) and the fd broker (malformed records, replayed tokens, a connection flood, a "
                    "foreign UID)", "one well-behaved client heartbeating and asking stats between every case",
                    "nothing: every case one exact error reply (or a dropped connection where the protocol says "
                    "so), epoch unchanged, no fd leaked, exit 0 on SIGTERM",
                    "cases %d (ZeroMQ %d, broker %d), failed %d" % (ok + bad, ok + bad - broker, broker, bad),
                    "pass" if b["result"] == "OK" else b["result"], "%.0f s" % b["duration"]])
    p = tests.get("persist")
    if p:
        text = p.get("stdout", "") + (p.get("stderr") or "")
        m = re.search(r"(\d+) kill -9 rounds: (\d+) chunks known durable at kill time", text)
        first = re.search(r"restart to first L2 hit: (\d+) ms", text)
        res = "pass" if p["result"] == "OK" else p["result"]
        out.append(["tests/integration/test_persist.c kill9_rounds: SIGKILL of the server at a random point "
                    "(seed 7, within 0.4 s) of one-chunk store jobs, restart, each round",
                    "4 C rank processes (2 groups each), store jobs in chunk order",
                    "only writes not yet committed to L2: every chunk known durable at the kill was served, all "
                    "byte-exact, 0 checksum failures",
                    ("rounds %s, chunks known durable at kill time %s" % (m.group(1), m.group(2)) if m else "-") +
                    (", restart to first L2 hit %s ms" % first.group(1) if first else ""),
                    res, "%.0f s (whole test)" % p["duration"]])
        out.append(["tests/integration/test_persist.c corruption_is_a_counted_miss: one byte flipped in an "
                    "object's data in data.mdb (server stopped)", "4 C rank processes, 2 chunks",
                    "the damaged object only: a miss (E_MISS, nothing written), l2_checksum_failures 1, the "
                    "object deleted; the other chunk byte-exact", "objects damaged 1, served wrong 0", res, "-"])
    return out


def render(rows, meta):
    lines = [BEGIN, "", meta, "",
             "| fault or bad input | load held | what was lost | numbers | result | time |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    lines += ["", END]
    return "\n".join(lines)


def rewrite(doc, table):
    with open(doc) as f:
        text = f.read()
    a, b = text.find(BEGIN), text.find(END)
    if a < 0 or b < a:
        sys.exit("%s: the markers are missing:\n%s\n%s" % (doc, BEGIN, END))
    text = text[:a] + table + text[b + len(END):]
    with open(doc, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-C", "--build", default="build", help="meson build directory (default build)")
    ap.add_argument("--results", help="chaos results file of an earlier run (KVT_CHAOS_RESULTS); no run")
    ap.add_argument("--no-run", action="store_true", help="tables from the last run's files in the build's "
                    "meson-logs (chaos-results.jsonl, hostile.json)")
    ap.add_argument("--hostile-log", help="meson JSON test log of badinput and persist of an earlier run")
    ap.add_argument("--doc", default=DOC)
    ap.add_argument("--print", action="store_true", help="print the table instead of rewriting the doc")
    args = ap.parse_args()
    build = os.path.join(ROOT, args.build) if not os.path.isabs(args.build) else args.build
    rc_all = 0
    times = []
    logs = os.path.join(build, "meson-logs")
    if args.results or args.no_run:
        results = args.results or os.path.join(logs, "chaos-results.jsonl")
    else:
        os.makedirs(logs, exist_ok=True)
        results = os.path.join(logs, "chaos-results.jsonl")
        open(results, "w").close()
        rc, t = run(["meson", "test", "-C", build, "--suite", "chaos", "--print-errorlogs", "--logbase", "chaos"],
                    env=dict(os.environ, KVT_CHAOS_RESULTS=results))
        rc_all |= rc
        times.append("chaos suite %.0f s" % t)
    if args.hostile_log:
        hostile = args.hostile_log
    elif args.results or args.no_run:
        hostile = os.path.join(logs, "hostile.json")
    else:
        rc, t = run(["meson", "test", "-C", build, "badinput", "persist", "--logbase", "hostile"])
        rc_all |= rc
        times.append("badinput + persist %.0f s" % t)
        hostile = os.path.join(logs, "hostile.json")
    rows = chaos_rows(results) + hostile_rows(hostile)
    if not times:  # no run here: the durations the meson logs recorded
        for base, what in (("chaos", "chaos suite"), ("hostile", "badinput + persist")):
            try:
                with open(os.path.join(logs, base + ".json")) as f:
                    times.append("%s %.0f s" % (what, sum(json.loads(x)["duration"] for x in f if x.strip())))
            except (OSError, ValueError, KeyError):
                pass
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = "Last refreshed %s on %d CPU cores%s (`tools/reliability-table.py`)." % (
        when, os.cpu_count() or 0, ": " + ", ".join(times) if times else "")
    table = render(rows, meta)
    if args.print:
        print(table)
    else:
        rewrite(args.doc, table)
        print("rewrote the table in %s (%d rows)" % (os.path.relpath(args.doc), len(rows)), file=sys.stderr)
    if any(r[4] not in ("pass", "skipped") for r in rows):
        rc_all = rc_all or 1
    return 1 if rc_all else 0


if __name__ == "__main__":
    sys.exit(main())
