"""Shared parts of the chaos suite (tests/chaos, issue 16 "What must be
shown"): real kvside-server processes (tests/python/kvt_server.py), real rank
processes (chaos_rank.py: the Python binding, a memfd HostMemory region, one
process per rank, driven over a pipe), the object bytes every rank stores
(derived from its rank and the chunk key, so any process can check a
retrieved object), deadlines checked on every request, and the results
record that tools/reliability-table.py turns into docs/reliability.md.

Environment: as tests/python (KVS_SERVER, KVSIDE_LIB, PYTHONPATH with
worker/python and tests/python), plus
  KVT_CHAOS_RESULTS  a file: each scenario appends one JSON line (fault, load,
                     loss, numbers, pass/fail)
  KVT_CHAOS_FLIP_BYTE=1  a dry run: each rank flips one byte of the first
                     object it retrieved before checking it (the check must
                     then fail the scenario)."""

import faulthandler
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import unittest

import kvside
from kvt_server import Server  # noqa: F401  (re-exported for the scenarios)

HERE = os.path.dirname(os.path.abspath(__file__))
TPB = 16                 # tokens per block
# a request may come back this long after its own timeout (a loaded 2-core
# machine, Python, the pipe to the rank process) and still count as "by its
# deadline"
DEADLINE_SLACK_MS = 2000


# ---- object bytes and keys ------------------------------------------------------------------

def object_bytes(rank, key, nbytes):
    """The bytes rank stores under chunk key (the same in every process)."""
    return hashlib.shake_128(b"kvside-chaos:%d:" % rank + bytes(key)).digest(nbytes)


_key_cache = {}


def keys_of(ns, prompt, n, chunk_tokens):
    """The first n chunk keys of prompt number `prompt` in namespace ns."""
    ck = (ns, prompt, chunk_tokens)
    have = _key_cache.get(ck)
    if have is None or len(have) < n:
        m = max(n, 64)
        toks = [(prompt * 1000003 + i) & 0xFFFFFFFF for i in range(m * chunk_tokens)]
        have = kvside.chunk_keys(ns, toks, chunk_tokens)
        _key_cache[ck] = have
    return have[:n]


# ---- deadlines ------------------------------------------------------------------------------

class Deadlines:
    """Counts requests and those answered (or failed) later than their own
    timeout plus DEADLINE_SLACK_MS."""

    def __init__(self):
        self.requests = 0
        self.late = []

    def call(self, what, timeout_ms, fn, *a, **kw):
        """fn(*a, timeout_ms=timeout_ms, **kw), timed; returns (result, error)."""
        t0 = time.monotonic()
        err = None
        res = None
        try:
            res = fn(*a, timeout_ms=timeout_ms, **kw)
        except kvside.KvsideError as e:
            err = e
        ms = (time.monotonic() - t0) * 1000
        self.requests += 1
        if ms > timeout_ms + DEADLINE_SLACK_MS:
            self.late.append("%s took %.0f ms (timeout %d ms)" % (what, ms, timeout_ms))
        return res, err

    def merge(self, other):
        self.requests += other.get("requests", 0)
        self.late += other.get("late", [])


def wait_session(dl, client, timeout_s=20):
    """After a server restart a client's first requests fail with E_SESSION
    until it has re-opened its session (protocol §8.3): ask for stats until
    one is answered. Returns the stats."""
    end = time.monotonic() + timeout_s
    while True:
        st, e = dl.call("stats", 2000, client.stats)
        if e is None:
            return st
        if time.monotonic() > end:
            raise AssertionError("the client never re-opened its session: %s" % e)
        time.sleep(0.05)


def err_name(e):
    return None if e is None else (e.code_name or str(e))


# ---- rank processes -------------------------------------------------------------------------

class Rank:
    """One rank: a child process (chaos_rank.py) holding a client session and
    a registered memfd region of `blocks` blocks of block_bytes (one
    attention group, one layer, blocks_per_chunk bpc): the first half is the
    store source, the second half the retrieve destination. Commands and
    replies are JSON lines over its stdin/stdout."""

    def __init__(self, srv, engine, ns, rank=0, world=1, blocks=256, block_bytes=16 << 10, bpc=2,
                 timeout_ms=5000, preexec_fn=None, env=None):
        self.rank, self.world, self.ns, self.bpc = rank, world, ns, bpc
        self.block_bytes, self.blocks = block_bytes, blocks
        self.obj_bytes = bpc * block_bytes
        self.chunk_tokens = TPB * bpc
        args = [sys.executable, os.path.join(HERE, "chaos_rank.py"), srv.run, engine, ns, str(rank), str(world),
                str(blocks), str(block_bytes), str(bpc), str(timeout_ms)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=preexec_fn, env=env)
        ready = self._read(60)
        if not ready.get("ok"):
            raise RuntimeError("rank %d did not start: %s" % (rank, ready))

    def _read(self, timeout):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise RuntimeError("rank %d: no answer within %d s" % (self.rank, timeout))
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("rank %d exited (%s)" % (self.rank, self.proc.poll()))
        return json.loads(line)

    def send(self, op, **kw):
        kw["op"] = op
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout=120):
        return self._read(timeout)

    def do(self, op, timeout=120, **kw):
        self.send(op, **kw)
        return self.recv(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("stop")  # ends a loop; otherwise answered as unknown
                self.send("exit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def stop_together(ranks, sync_dir, margin=20, timeout=120):
    """Stops the loops of the ranks of one job (started with sync_dir) after
    the same job: a stop id `margin` jobs beyond the furthest rank (the ranks
    of a job are never more than one job apart). Returns their replies."""
    at = 0
    for r in ranks:
        try:
            with open(os.path.join(sync_dir, "rank%d" % r.rank)) as f:
                at = max(at, int(f.read() or 0))
        except (OSError, ValueError):
            pass
    tmp = os.path.join(sync_dir, "stop.tmp")
    with open(tmp, "w") as f:
        f.write(str(at + margin))
    os.replace(tmp, os.path.join(sync_dir, "stop"))
    return [r.recv(timeout) for r in ranks]


def all_do(ranks, op, timeout=120, **kw):
    """The same command to every rank at once (the parts of one job); their
    replies in rank order."""
    for r in ranks:
        r.send(op, **kw)
    return [r.recv(timeout) for r in ranks]


# ---- results --------------------------------------------------------------------------------

def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def record(scenario, fault, load, lost, numbers, ok, seconds):
    """One scenario's line in $KVT_CHAOS_RESULTS (and on stdout for the test log)."""
    row = {"scenario": scenario, "fault": fault, "load": load, "lost": lost, "numbers": numbers,
           "result": "skipped" if ok is None else "pass" if ok else "FAIL", "seconds": round(seconds, 1)}
    line = json.dumps(row, sort_keys=True)
    print("# chaos-result " + line, flush=True)
    path = os.environ.get("KVT_CHAOS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class Scenario:
    """Collects one scenario's facts; record() them whatever the outcome:
        with Scenario("kill9", fault=..., load=...) as sc:
            sc.numbers["rounds"] = 6 ...
            sc.lost = "nothing committed"
    A failure inside the block is recorded as FAIL and re-raised."""

    def __init__(self, name, fault, load="", lost=""):
        self.name, self.fault, self.load, self.lost = name, fault, load, lost
        self.numbers = {}
        self.t0 = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        ok = et is None
        if et is not None and issubclass(et, unittest.SkipTest):
            record(self.name, self.fault, self.load, "not run: %s" % ev, self.numbers, None,
                   time.monotonic() - self.t0)
            return False
        lost = self.lost if ok else "FAILED: %s" % (str(ev).splitlines()[0][:300] if ev else et.__name__)
        record(self.name, self.fault, self.load, lost, self.numbers, ok, time.monotonic() - self.t0)
        return False


def sleep_alive(srv, seconds):
    """Sleeps, failing at once if the server dies meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rc = srv.proc.poll() if srv.proc else None
        if rc is not None:
            raise AssertionError("server died (exit %s)%s" % (rc, tail(srv)))
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def watchdog(srv, seconds, what):
    """Writes every thread's stack and the server log's tail to stderr if
    still running after `seconds` (set just under meson's time-out), so a
    hang says where it hung rather than ending without output. Returns the
    timer: cancel() it when done."""
    def fire():
        sys.stderr.write("\n=== %s still running after %d s; where each thread is: ===\n" % (what, seconds))
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            sys.stderr.write(tail(srv, 80) + "\n")
        except Exception as e:  # the log may be between starts
            sys.stderr.write("(no server log: %s)\n" % e)
        sys.stderr.flush()
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def stat_delta(a, b, name):
    return b.get(name, 0) - a.get(name, 0)


def tail(srv, n=40):
    return "\nserver log:\n" + srv.log_tail(n)
