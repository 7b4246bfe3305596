#!/usr/bin/python3
"""Hostile-input integration test for kvside-server (docs/design.md §4, §10).

Starts the real server, keeps one well-behaved DEALER client alive throughout
(heartbeat + stats between every case, asserting both keep working and the
epoch never changes), and throws malformed or hostile input at it over other
sockets:

  * ZeroMQ: bytes that are not msgpack, truncated msgpack, non-map roots,
    broken envelopes (id/v/op missing or mistyped), unknown ops, missing and
    mistyped fields, out-of-range values, unknown/expired sessions, oversized
    arrays/strings/messages/nesting, trailing bytes, multipart messages,
    duplicate keys, wrong-sized binaries, unknown extra keys (ignored).
    Every hostile request must get exactly one error reply with the exact
    `code`, `ok` false, `id` echoed where the envelope is readable, a 16-byte
    `epoch`, `v` 1 and a non-empty `msg`.
  * fd broker (AF_UNIX SOCK_SEQPACKET + SCM_RIGHTS): records without an fd,
    with two fds, of the wrong length, with a bad magic/version/flags, a valid
    record followed by a replayed token, a connection flood, an idle
    connection, and (when run as root) a peer with a foreign UID. Each must
    close the connection and park nothing; the one valid fd is closed again
    by the server after --fd-park-ms.

At the end the server is still alive, the good client still works, the
errors.E_* counters grew by exactly the replies counted here, the server has
as many open fds as right after start-up, and SIGTERM stops it with exit 0.

Usage: test_badinput.py /path/to/kvside-server
"""

import array
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import msgpack
import zmq

# the well-behaved client's lease: long enough that its session outlives a
# slow hostile case on a loaded 2-core machine (three of these tests in
# parallel there took 2.4 s to get the 160 KiB "lookup with 5000 keys" answered,
# 1 ms alone), so that "expired" here only ever means the expiry case
TTL_MS = 8000
HEARTBEAT_MS = 200
FD_PARK_MS = 1000
MAX_MSG = 8 << 20
RECV_TIMEOUT_MS = 5000

# kvs_error.h: KVS_E_BASE = -20000 is E_BADMSG, then +1 each in order.
ERR_NAMES = ["E_BADMSG", "E_VERSION", "E_UNKNOWN_OP", "E_LIMIT", "E_SESSION", "E_AUTH",
             "E_NOREG", "E_GEOMETRY", "E_RANGE", "E_JOB_CONFLICT", "E_JOB_STATE",
             "E_NOSPACE", "E_MISS", "E_BUSY", "E_DEVICE", "E_LAZY_RECURRENT", "E_TIMEOUT",
             "E_INTERNAL"]
ERR = {name: -20000 + i for i, name in enumerate(ERR_NAMES)}
assert ERR["E_AUTH"] == -19995

BOGUS_SESSION = 0x0123456789ABCDEF


class Fail(AssertionError):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def pack_pairs(pairs):
    """A msgpack map from a list of (key, value) pairs, duplicates allowed."""
    n = len(pairs)
    assert n < 16
    out = bytes([0x80 | n])
    for k, v in pairs:
        out += pack(k) + pack(v)
    return out


def unpack(buf):
    return msgpack.unpackb(buf, raw=False, strict_map_key=False)


def hello_req(rid, **over):
    m = {"v": 1, "op": "hello", "id": rid, "engine": "badinput-test", "role": "worker",
         "rank": 0, "world": 1, "namespace": "ns-badinput"}
    m.update(over)
    return m


def nested(depth, leaf=1):
    """depth nested arrays around leaf."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


class Server:
    def __init__(self, exe, tmp):
        self.run_dir = os.path.join(tmp, "run")
        self.sock_path = os.path.join(self.run_dir, "kvside.sock")
        self.zmq_path = os.path.join(self.run_dir, "kvside.zmq")
        self.endpoint = "ipc://" + self.zmq_path
        self.log_path = os.path.join(tmp, "server.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, "--broker-dir", self.run_dir, "--ttl-ms", str(TTL_MS),
             "--heartbeat-ms", str(HEARTBEAT_MS), "--fd-park-ms", str(FD_PARK_MS),
             "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def nfds(self):
        return len(os.listdir("/proc/%d/fd" % self.pid))

    def memfds(self, name):
        """How many of the server's fds are memfds called name."""
        n = 0
        d = "/proc/%d/fd" % self.pid
        for e in os.listdir(d):
            try:
                if os.readlink(os.path.join(d, e)).startswith("/memfd:%s " % name):
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def log_text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def kill(self):
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Client:
    """A DEALER socket speaking msgpack requests, one reply at a time."""

    def __init__(self, ctx, endpoint, name):
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.next_id = 1000

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def send_raw(self, data):
        self.sock.send(data)

    def recv(self, timeout_ms=RECV_TIMEOUT_MS):
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            raise Fail("%s: no reply within %d ms" % (self.name, timeout_ms))
        frames = self.sock.recv_multipart()
        check(len(frames) == 1, "%s: reply has %d frames" % (self.name, len(frames)))
        rep = unpack(frames[0])
        check(isinstance(rep, dict), "%s: reply is not a map: %r" % (self.name, rep))
        return rep

    def pending(self):
        return bool(self.sock.poll(0, zmq.POLLIN))

    def call(self, msg):
        self.send_raw(pack(msg))
        return self.recv()

    def close(self):
        self.sock.close(0)


class Test:
    def __init__(self, exe):
        self.exe = exe
        self.tmp = tempfile.mkdtemp(prefix="kvs-bad-")
        self.ctx = zmq.Context()
        self.srv = None
        self.epoch = None
        self.expect_err = {n: 0 for n in ERR_NAMES}  # error replies we provoked
        self.cases = []

    # ---- assertions on replies -------------------------------------------

    def check_envelope(self, rep, what):
        check(rep.get("v") == 1, "%s: v is %r" % (what, rep.get("v")))
        ep = rep.get("epoch")
        check(isinstance(ep, bytes) and len(ep) == 16, "%s: epoch %r" % (what, ep))
        if self.epoch is not None:
            check(ep == self.epoch, "%s: epoch changed" % what)
        check(isinstance(rep.get("op"), str) and rep["op"], "%s: op %r" % (what, rep.get("op")))
        check(isinstance(rep.get("id"), int), "%s: id %r" % (what, rep.get("id")))
        check(isinstance(rep.get("ok"), bool), "%s: ok %r" % (what, rep.get("ok")))

    def check_ok(self, rep, op, rid, what):
        self.check_envelope(rep, what)
        check(rep["ok"] is True, "%s: expected ok, got %r" % (what, rep))
        check(rep["op"] == op, "%s: op %r, expected %r" % (what, rep["op"], op))
        check(rep["id"] == rid, "%s: id %r, expected %r" % (what, rep["id"], rid))

    def check_err(self, rep, code, what, rid=None, op=None, msg_has=None):
        self.check_envelope(rep, what)
        check(rep["ok"] is False, "%s: expected an error, got %r" % (what, rep))
        check(rep.get("code") == code, "%s: code %r, expected %s (msg %r)"
              % (what, rep.get("code"), code, rep.get("msg")))
        m = rep.get("msg")
        check(isinstance(m, str) and m.strip(), "%s: msg %r" % (what, m))
        if rid is not None:
            check(rep["id"] == rid, "%s: id %r, expected %r" % (what, rep["id"], rid))
        if op is not None:
            check(rep["op"] == op, "%s: op %r, expected %r" % (what, rep["op"], op))
        if msg_has is not None:
            check(msg_has in m, "%s: msg %r does not mention %r" % (what, m, msg_has))
        self.expect_err[code] += 1

    # ---- the well-behaved client -----------------------------------------

    def good_check(self, what):
        check(self.srv.alive(), "server died after: %s" % what)
        rid = self.good.new_id()
        rep = self.good.call({"v": 1, "op": "heartbeat", "id": rid, "session": self.session})
        self.check_ok(rep, "heartbeat", rid, "good heartbeat after " + what)
        check(isinstance(rep.get("pending_jobs"), int), "heartbeat: pending_jobs missing")
        st = self.stats()
        # every hostile request got exactly one reply: nothing is left over
        for c in self.hostiles:
            check(not c.pending(), "%s: unexpected extra message after %s" % (c.name, what))
        return st

    def stats(self):
        rid = self.good.new_id()
        rep = self.good.call({"v": 1, "op": "stats", "id": rid, "session": self.session})
        self.check_ok(rep, "stats", rid, "good stats")
        c = rep.get("counters")
        check(isinstance(c, dict) and "parked_fds" in c and "errors.E_BADMSG" in c,
              "stats counters %r" % c)
        for k, v in c.items():
            check(isinstance(k, str) and isinstance(v, int) and v >= 0, "counter %r=%r" % (k, v))
        return c

    # ---- start-up ----------------------------------------------------------

    def start(self):
        self.srv = Server(self.exe, self.tmp)
        deadline = time.monotonic() + 10
        while not (os.path.exists(self.srv.sock_path) and os.path.exists(self.srv.zmq_path)):
            check(self.srv.alive(), "server exited at start-up:\n" + self.srv.log_text())
            check(time.monotonic() < deadline, "server sockets did not appear")
            time.sleep(0.02)
        st = os.stat(self.srv.run_dir)
        check(st.st_mode & 0o777 == 0o700, "run dir mode %o" % (st.st_mode & 0o777))
        check(os.stat(self.srv.sock_path).st_mode & 0o777 == 0o600, "broker socket mode")
        self.good = Client(self.ctx, self.srv.endpoint, "good")
        rep = self.good.call(hello_req(1, engine="good-client"))
        self.check_ok(rep, "hello", 1, "good hello")
        self.epoch = rep["epoch"]
        self.session = rep["session"]
        check(isinstance(self.session, int) and self.session > 0, "session %r" % self.session)
        check(rep.get("ttl_ms") == TTL_MS and rep.get("heartbeat_ms") == HEARTBEAT_MS,
              "hello timings %r" % rep)
        lim = rep.get("limits")
        check(isinstance(lim, dict) and lim.get("max_msg_bytes") == MAX_MSG
              and lim.get("max_keys") == 4096, "hello limits %r" % lim)
        self.hostiles = []
        self.base = self.stats()
        time.sleep(0.2)  # let ZeroMQ's I/O thread settle before counting fds
        self.base_fds = self.srv.nfds()
        self.t0 = time.monotonic()

    # ---- ZeroMQ cases -------------------------------------------------------

    def zmq_cases(self):
        h = Client(self.ctx, self.srv.endpoint, "hostile")
        self.hostiles.append(h)
        B, V, U, L, S = "E_BADMSG", "E_VERSION", "E_UNKNOWN_OP", "E_LIMIT", "E_SESSION"

        def raw(name, data, code, rid=0, op=None, msg_has=None):
            """data: bytes sent as one frame; rid: id the reply must echo."""
            h.send_raw(data)
            self.check_err(h.recv(), code, name, rid=rid, op=op, msg_has=msg_has)
            self.cases.append(name)
            self.good_check(name)

        def req(name, msg, code, op=None, msg_has=None, echo=True):
            raw(name, pack(msg), code, rid=msg.get("id", 0) if echo else 0, op=op,
                msg_has=msg_has)

        hb = {"v": 1, "op": "heartbeat", "session": BOGUS_SESSION}
        valid_hello = pack(hello_req(11))

        # not msgpack / broken msgpack / not a map
        raw("byte 0xc1 (never used in msgpack)", b"\xc1", B)
        raw("0xc1 inside a map", b"\x81\xa1x\xc1", B)
        raw("empty frame", b"", B)
        raw("truncated msgpack", valid_hello[:-3], B, rid=11, op="hello")
        raw("truncated container header", b"\xdf\xff\xff", B)
        raw("map claiming 2^32-1 pairs", b"\xdf\xff\xff\xff\xff" + b"\xc0" * 64, B)
        raw("str claiming 4 GiB", b"\x81\xa2id\xdb\xff\xff\xff\xff", B)
        raw("root is an array", pack([1, "hello", 3]), B, msg_has="map")
        raw("root is an int", pack(42), B, msg_has="map")
        raw("root is a string", pack("hello"), B, msg_has="map")
        raw("root is nil", b"\xc0", B)
        raw("trailing bytes after the map", valid_hello + b"\x00", B, rid=11, op="hello",
            msg_has="trailing")

        # envelope
        req("missing id", dict(hb), B, msg_has="id")
        req("id is a string", dict(hb, id="7"), B, echo=False, msg_has="id")
        req("id is negative", dict(hb, id=-5), B, echo=False, msg_has="id")
        req("id is a float", dict(hb, id=1.5), B, echo=False, msg_has="id")
        req("missing v", {"op": "heartbeat", "id": 21, "session": 1}, B, op="heartbeat",
            msg_has="v")
        req("v is a string", dict(hb, id=22, v="1"), B, op="heartbeat")
        req("v = 2", dict(hb, id=23, v=2), V, op="heartbeat")
        req("v = 0", dict(hb, id=24, v=0), V, op="heartbeat")
        req("missing op", {"v": 1, "id": 25, "session": 1}, B, msg_has="op")
        req("op is an int", {"v": 1, "op": 5, "id": 26}, B, msg_has="op")
        req("op is binary", {"v": 1, "op": b"hello", "id": 27}, B, msg_has="op")
        req("unknown op", {"v": 1, "op": "frobnicate", "id": 28}, U, msg_has="frobnicate")
        req("op 'job_done' as a request", {"v": 1, "op": "job_done", "id": 29, "job": 1,
                                           "state": "committed", "reason": ""}, U)
        req("op name with NUL", {"v": 1, "op": "hello\x00", "id": 30}, U)
        req("unknown op, id 2^64-1 echoed", {"v": 1, "op": "nope", "id": (1 << 64) - 1}, U)
        raw("duplicate envelope key (id)",
            pack_pairs([("v", 1), ("op", "stats"), ("id", 31), ("id", 31)]), B, rid=31,
            op="stats", msg_has="duplicate")
        raw("duplicate field key (engine)",
            pack_pairs([("v", 1), ("op", "hello"), ("id", 32), ("engine", "a"),
                        ("engine", "b"), ("role", "worker"), ("rank", 0), ("world", 1),
                        ("namespace", "n")]), B, rid=32, op="hello", msg_has="duplicate")
        raw("non-string map key", pack({"v": 1, "op": "stats", "id": 33, 7: 1}), B, rid=33,
            op="stats")

        # hello fields
        hello_missing_engine = hello_req(40)
        del hello_missing_engine["engine"]
        req("hello without engine", hello_missing_engine, B, op="hello", msg_has="engine")
        hello_missing_ns = hello_req(41)
        del hello_missing_ns["namespace"]
        req("hello without namespace", hello_missing_ns, B, op="hello", msg_has="namespace")
        req("hello rank as string", hello_req(42, rank="0"), B, op="hello", msg_has="rank")
        req("hello world negative", hello_req(43, world=-1), B, op="hello", msg_has="world")
        req("hello world = 0", hello_req(44, world=0), B, op="hello", msg_has="world")
        req("hello rank >= world (worker)", hello_req(45, rank=4, world=4), B, op="hello")
        req("hello rank 2^32 (u32 overflow)", hello_req(46, rank=1 << 32, world=1), B,
            op="hello")
        req("hello role unknown", hello_req(47, role="admin"), B, op="hello", msg_has="role")
        req("hello engine empty", hello_req(48, engine=""), B, op="hello", msg_has="engine")
        req("hello engine is binary", hello_req(49, engine=b"abc"), B, op="hello")
        req("hello engine of 200 chars", hello_req(50, engine="e" * 200), L, op="hello",
            msg_has="engine")
        req("hello namespace of 129 chars", hello_req(51, namespace="n" * 129), L, op="hello")

        # session ops
        req("heartbeat without session", {"v": 1, "op": "heartbeat", "id": 60}, B,
            op="heartbeat", msg_has="session")
        req("heartbeat session as string", {"v": 1, "op": "heartbeat", "id": 61,
                                            "session": str(self.session)}, B, op="heartbeat")
        req("heartbeat for an unknown session", dict(hb, id=62), S, op="heartbeat")
        req("bye for an unknown session", {"v": 1, "op": "bye", "id": 63,
                                           "session": BOGUS_SESSION}, S, op="bye")

        # ops served by someone else: only decode-level errors
        key = b"\x11" * 32
        req("lookup with 5000 keys", {"v": 1, "op": "lookup", "id": 70,
                                      "session": BOGUS_SESSION, "keys": [key] * 5000}, L,
            op="lookup", msg_has="keys")
        req("lookup key of 31 bytes", {"v": 1, "op": "lookup", "id": 71,
                                       "session": BOGUS_SESSION, "keys": [key, b"k" * 31]},
            B, op="lookup", msg_has="keys")
        req("lookup key as string", {"v": 1, "op": "lookup", "id": 72,
                                     "session": BOGUS_SESSION, "keys": ["k" * 32]},
            B, op="lookup")
        req("lookup keys not an array", {"v": 1, "op": "lookup", "id": 73,
                                         "session": BOGUS_SESSION, "keys": key}, B,
            op="lookup")
        req("lookup without keys", {"v": 1, "op": "lookup", "id": 74,
                                    "session": BOGUS_SESSION}, B, op="lookup", msg_has="keys")
        req("lookup pin_ms too large", {"v": 1, "op": "lookup", "id": 75,
                                        "session": BOGUS_SESSION, "keys": [key],
                                        "pin_ms": 10 ** 9}, B, op="lookup")
        req("lookup well-formed, unknown session", {"v": 1, "op": "lookup", "id": 76,
                                                    "session": BOGUS_SESSION, "keys": [key]},
            S, op="lookup")
        req("store without blocks", {"v": 1, "op": "store", "id": 77,
                                     "session": BOGUS_SESSION, "job": 1, "keys": [key]}, B,
            op="store", msg_has="blocks")
        req("store with 17 block groups", {"v": 1, "op": "store", "id": 78,
                                           "session": BOGUS_SESSION, "job": 1, "keys": [key],
                                           "blocks": [[1]] * 17}, L, op="store")
        req("store block id not an integer", {"v": 1, "op": "store", "id": 79,
                                              "session": BOGUS_SESSION, "job": 1,
                                              "keys": [key], "blocks": [["x"]]}, B,
            op="store")
        req("store producer_event of 65 bytes", {"v": 1, "op": "store", "id": 80,
                                                 "session": BOGUS_SESSION, "job": 1,
                                                 "keys": [key], "blocks": [[1]],
                                                 "producer_event": b"e" * 65}, L, op="store")
        req("complete status unknown", {"v": 1, "op": "complete", "id": 81,
                                        "session": BOGUS_SESSION, "job": 1,
                                        "status": "maybe"}, B, op="complete")
        req("register allocations not maps", {
            "v": 1, "op": "register", "id": 82, "session": BOGUS_SESSION,
            "device": {"type": "host", "uuid": b"u" * 16}, "allocations": [1],
            "groups": [], "layers": []}, B, op="register")
        req("register token of 15 bytes", {
            "v": 1, "op": "register", "id": 83, "session": BOGUS_SESSION,
            "device": {"type": "host", "uuid": b"u" * 16},
            "allocations": [{"token": b"t" * 15, "alloc_id": b"a" * 16, "size": 4096}],
            "groups": [], "layers": []}, B, op="register", msg_has="token")
        req("register with 257 allocations", {
            "v": 1, "op": "register", "id": 84, "session": BOGUS_SESSION,
            "device": {"type": "host", "uuid": b"u" * 16},
            "allocations": [{"token": b"t" * 16, "alloc_id": b"a" * 16, "size": 1}] * 257,
            "groups": [], "layers": []}, L, op="register")
        req("job_status with 1025 ids", {"v": 1, "op": "job_status", "id": 85,
                                         "session": BOGUS_SESSION, "jobs": list(range(1025))},
            L, op="job_status")

        # structural limits
        req("nesting depth 7", dict(hello_req(90), x=nested(6)), L, op="hello",
            msg_has="nesting")
        req("nesting depth 400", dict(hello_req(91), x=nested(400)), L, op="hello")
        # exactly 8 MiB is served; one byte more is E_LIMIT (ZeroMQ itself only
        # drops messages above 8 MiB + 4096, so the server answers these)
        def sized(rid, total):
            pad = total - len(pack(dict(hello_req(rid), pad=b""))) - 3  # bin8 -> bin32 header
            data = pack(dict(hello_req(rid), pad=b"\0" * pad))
            check(len(data) == total, "message size %d != %d" % (len(data), total))
            return data
        h.send_raw(sized(92, MAX_MSG))
        rep = h.recv()
        self.check_ok(rep, "hello", 92, "hello of exactly 8 MiB")
        self.bye(h, rep["session"])
        self.cases.append("message of exactly 8 MiB is served")
        self.good_check("exactly 8 MiB")
        raw("message of 8 MiB + 1 byte", sized(94, MAX_MSG + 1), L, rid=94, op="hello",
            msg_has="exceeds")
        req("2.1 million array elements", dict(hello_req(93), x=[0] * 2100000), L, op="hello",
            msg_has="elements")

        # extra frames
        h.sock.send_multipart([pack(hello_req(95)), b"second frame"])
        self.check_err(h.recv(), B, "two frames", rid=95, msg_has="frame")
        self.cases.append("two frames")
        self.good_check("two frames")
        h.sock.send_multipart([pack(hello_req(96)), b"", b"", b""])
        self.check_err(h.recv(), B, "four frames", rid=96, msg_has="frame")
        self.cases.append("four frames")
        self.good_check("four frames")

        # a pipelined burst: every request answered exactly once, matched by id
        kinds = [(b"\xc1", B, False), (None, U, True), (None, V, True), (None, L, True),
                 (None, S, True), (None, B, True)]
        burst, want = [], {}
        for i in range(3000):
            rid = 10000 + i
            data, code, echo = kinds[i % len(kinds)]
            if data is None:
                m = {"v": 1, "op": "heartbeat", "id": rid, "session": BOGUS_SESSION}
                if code == U:
                    m["op"] = "op%d" % i
                elif code == V:
                    m["v"] = 3
                elif code == L:
                    m["op"], m["engine"] = "hello", "x" * 129
                elif code == B:
                    del m["session"]
                data = pack(m)
            burst.append(data)
            if echo:
                want[rid] = code
            else:
                want.setdefault(0, []).append(code)
        for data in burst:
            h.send_raw(data)
        got_zero = []
        for _ in range(len(burst)):
            rep = h.recv()
            self.check_envelope(rep, "burst")
            check(rep["ok"] is False and rep.get("msg"), "burst reply %r" % rep)
            self.expect_err[rep["code"]] += 1
            if rep["id"] == 0:
                got_zero.append(rep["code"])
            else:
                check(want.pop(rep["id"], None) == rep["code"],
                      "burst: unexpected or repeated reply %r" % rep)
        check(sorted(got_zero) == sorted(want.pop(0)) and not want,
              "burst: replies missing for %r" % sorted(want)[:10])
        self.cases.append("pipelined burst of 3000 bad requests, one reply each")
        self.good_check("burst")

        # accepted edge cases: unknown keys are ignored, depth 6 is allowed
        rep = h.call(dict(hello_req(100), extra_key="ignored", another={"deep": [1, 2]}))
        self.check_ok(rep, "hello", 100, "hello with unknown extra keys")
        self.bye(h, rep["session"])
        self.cases.append("unknown extra keys are ignored")
        rep = h.call(dict(hello_req(101), x=nested(5)))
        self.check_ok(rep, "hello", 101, "hello with nesting depth 6")
        self.bye(h, rep["session"])
        self.cases.append("nesting depth 6 is accepted")
        rep = h.call(hello_req(102, role="scheduler", rank=0, world=8))
        self.check_ok(rep, "hello", 102, "scheduler hello")
        self.bye(h, rep["session"])
        rep = h.call({"v": 1, "op": "stats", "id": 103})
        self.check_ok(rep, "stats", 103, "stats without a session (any sender, no fields)")
        check(isinstance(rep.get("counters"), dict), "stats without session: counters")
        self.cases.append("stats without a session")
        self.good_check("accepted edge cases")

    def bye(self, client, session):
        rid = client.new_id()
        rep = client.call({"v": 1, "op": "bye", "id": rid, "session": session})
        self.check_ok(rep, "bye", rid, "bye")
        rep = client.call({"v": 1, "op": "heartbeat", "id": rid + 1, "session": session})
        self.check_err(rep, "E_SESSION", "heartbeat after bye", rid=rid + 1, op="heartbeat")

    def session_expiry_case(self):
        raw = Client(self.ctx, self.srv.endpoint, "expiring")
        self.hostiles.append(raw)
        rep = raw.call(hello_req(200, engine="expiring"))
        self.check_ok(rep, "hello", 200, "expiring hello")
        sid = rep["session"]
        rep = raw.call({"v": 1, "op": "heartbeat", "id": 201, "session": sid})
        self.check_ok(rep, "heartbeat", 201, "expiring heartbeat while alive")
        before = self.stats()
        # the good client keeps heartbeating while the other lease runs out
        end = time.monotonic() + (TTL_MS + 1000) / 1000.0
        while time.monotonic() < end:
            self.good_check("waiting for expiry")
            time.sleep(HEARTBEAT_MS / 1000.0)
        rep = raw.call({"v": 1, "op": "heartbeat", "id": 202, "session": sid})
        self.check_err(rep, "E_SESSION", "heartbeat after the lease ran out", rid=202,
                       op="heartbeat")
        after = self.good_check("session expired")
        check(after["sessions_reaped"] >= before["sessions_reaped"] + 1, "sessions_reaped")
        check(after["sessions"] == before["sessions"] - 1, "sessions %r -> %r"
              % (before["sessions"], after["sessions"]))
        self.cases.append("heartbeat for an expired session")
        raw.close()
        self.hostiles.remove(raw)

    def burst_case(self):
        """1,000 requests written at once over ZeroMQ (no lane): the loop
        reads at most 256 per pass, and ZeroMQ's fd signals only once for
        them, so the rest must be read without new traffic arriving
        (architecture.md §17.10: the loop asks ZMQ_EVENTS again after it
        used the socket). Every reply comes, in order, and nothing else."""
        n = 1000
        first = self.good.next_id + 1
        for i in range(n):
            self.good.send_raw(pack({"v": 1, "op": "heartbeat", "id": first + i, "session": self.session}))
        self.good.next_id += n
        for i in range(n):
            self.check_ok(self.good.recv(), "heartbeat", first + i, "heartbeat %d of a burst of %d" % (i + 1, n))
        check(not self.good.pending(), "an extra message after a burst")
        self.cases.append("a burst of 1,000 requests over ZeroMQ: all answered")

    def oversized_drop_case(self):
        """A message far above ZMQ_MAXMSGSIZE: ZeroMQ drops the connection
        (no reply is possible); the server must survive and serve a new one."""
        c = Client(self.ctx, self.srv.endpoint, "huge")
        c.send_raw(pack(dict(hello_req(300), pad=b"\0" * (12 << 20))))
        check(not c.sock.poll(1000, zmq.POLLIN), "reply to a 12 MiB message")
        c.close()
        self.good_check("12 MiB message")
        c = Client(self.ctx, self.srv.endpoint, "after-huge")
        rep = c.call({"v": 1, "op": "stats", "id": 301})
        self.check_ok(rep, "stats", 301, "new connection after a dropped one")
        c.close()
        self.cases.append("12 MiB message: connection dropped, server survives")

    # ---- fd broker cases ----------------------------------------------------

    def bconnect(self, path=None):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # a blocking connect waits for room in the listen backlog (a timed one
        # fails with EAGAIN at once when the server has not accepted yet)
        s.connect(path or self.srv.sock_path)
        s.settimeout(RECV_TIMEOUT_MS / 1000.0)
        return s

    @staticmethod
    def record(token, magic=b"KVSB", version=1, flags=0, alloc_id=b"A" * 16, size=4096):
        return magic + struct.pack("<HH", version, flags) + token + alloc_id + \
            struct.pack("<Q", size)

    @staticmethod
    def bsend(s, data, fds=()):
        if fds:
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            s.send(data)

    @staticmethod
    def brecv(s):
        """One record, or b'' once the server closed the connection."""
        try:
            return s.recv(64)
        except ConnectionResetError:
            return b""

    def expect_closed(self, s, what):
        d = self.brecv(s)
        check(d == b"", "%s: expected the connection closed, got %r" % (what, d))
        s.close()

    def broker_check(self, what, parked, rejected_delta):
        st = self.good_check(what)
        check(st["parked_fds"] == parked, "%s: parked_fds %d, expected %d"
              % (what, st["parked_fds"], parked))
        check(st["broker_rejected"] == self.rejected + rejected_delta,
              "%s: broker_rejected %d, expected %d" % (what, st["broker_rejected"],
                                                       self.rejected + rejected_delta))
        self.rejected = st["broker_rejected"]
        held = self.srv.memfds("kvs-badinput")
        check(held == parked - self.base_parked, "%s: server holds %d of our memfds, expected %d"
              % (what, held, parked - self.base_parked))
        return st

    def memfd(self):
        return os.memfd_create("kvs-badinput", os.MFD_CLOEXEC)

    def broker_cases(self):
        st = self.stats()
        base_parked = self.base_parked = st["parked_fds"]
        self.rejected = st["broker_rejected"]
        expired0 = st["broker_expired"]
        parked0 = st["broker_parked"]
        fd1, fd2 = self.memfd(), self.memfd()
        tok = os.urandom(16)

        def bad(name, data, fds):
            s = self.bconnect()
            self.bsend(s, data, fds)
            self.expect_closed(s, name)
            self.broker_check(name, base_parked, 1)
            self.cases.append("broker: " + name)

        bad("valid record without an fd", self.record(tok), ())
        bad("record with two fds", self.record(tok), (fd1, fd2))
        bad("garbage of 10 bytes", b"0123456789", (fd1,))
        bad("record of 47 bytes", self.record(tok)[:47], (fd1,))
        bad("record of 49 bytes", self.record(tok) + b"\0", (fd1,))
        bad("record of 4096 bytes", self.record(tok) + b"\0" * 4048, (fd1,))
        bad("wrong magic", self.record(tok, magic=b"KVSX"), (fd1,))
        bad("version 2 header over a version 1 body", self.record(tok, version=2), (fd1,))
        bad("flags 1", self.record(tok, flags=1), (fd1,))
        bad("reply magic sent as a request", b"KVSR" + b"\0" * 44, (fd1,))
        # a version this server does not read: refused with E_VERSION, then closed
        s = self.bconnect()
        self.bsend(s, self.record(tok, version=3), (fd1,))
        rep = self.brecv(s)
        check(rep == b"KVSR" + struct.pack("<i", ERR["E_VERSION"]), "version 3: reply %r" % rep)
        self.expect_closed(s, "version 3")
        self.broker_check("version 3", base_parked, 1)
        self.cases.append("broker: version 3 (E_VERSION)")
        s = self.bconnect()  # SCM_CREDENTIALS instead of SCM_RIGHTS: no fd
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        s.sendmsg([self.record(tok)], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                                        struct.pack("iII", os.getpid(), os.getuid(),
                                                    os.getgid()))])
        self.expect_closed(s, "SCM_CREDENTIALS instead of an fd")
        self.broker_check("SCM_CREDENTIALS instead of an fd", base_parked, 1)
        self.cases.append("broker: SCM_CREDENTIALS instead of an fd")

        # connect and hang up without a word: nothing to count
        s = self.bconnect()
        s.close()
        self.broker_check("connect and close", base_parked, 0)
        self.cases.append("broker: connect and close")

        # connection flood: the server holds at most 64 broker connections
        # (none is open now: the idle one was dropped before these cases)
        flood = [self.bconnect() for _ in range(70)]
        open_ = list(flood)
        closed = 0
        end = time.monotonic() + 3
        while open_ and closed < 6 and time.monotonic() < end:
            for s in list(open_):
                s.setblocking(False)
                try:
                    d = s.recv(64)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    d = b""
                check(d == b"", "flood: unexpected reply %r" % d)
                closed += 1
                open_.remove(s)
            time.sleep(0.02)
        check(closed == 6, "connection flood: %d connections refused, expected 6" % closed)
        for s in flood:
            s.close()
        time.sleep(0.2)  # the server sees the hang-ups: they count as nothing
        self.broker_check("connection flood", base_parked, closed)
        self.cases.append("broker: flood of 70 connections (limit 64)")

        self.foreign_uid_case(base_parked)

        # a valid record parks the fd; the same token again is refused with E_AUTH
        s = self.bconnect()
        self.bsend(s, self.record(tok), (fd1,))
        rep = self.brecv(s)
        check(rep == b"KVSR" + struct.pack("<i", 0), "valid record: reply %r" % rep)
        t_parked = time.monotonic()
        self.broker_check("valid record", base_parked + 1, 0)
        self.bsend(s, self.record(tok), (fd2,))
        rep = self.brecv(s)
        check(rep == b"KVSR" + struct.pack("<i", ERR["E_AUTH"]),
              "replayed token (same connection): reply %r" % rep)
        self.expect_closed(s, "replayed token (same connection)")
        self.broker_check("replayed token (same connection)", base_parked + 1, 1)
        s = self.bconnect()
        self.bsend(s, self.record(tok, alloc_id=b"B" * 16), (fd2,))
        rep = self.brecv(s)
        check(rep == b"KVSR" + struct.pack("<i", ERR["E_AUTH"]),
              "replayed token (new connection): reply %r" % rep)
        self.expect_closed(s, "replayed token (new connection)")
        self.broker_check("replayed token (new connection)", base_parked + 1, 1)
        self.cases.append("broker: valid record, then the same token replayed (E_AUTH) twice")
        # the parked fd is the server's own copy: closing ours changes nothing

        os.close(fd1)
        os.close(fd2)
        # the parked fd is closed after --fd-park-ms
        while time.monotonic() < t_parked + (FD_PARK_MS + 500) / 1000.0:
            self.good_check("waiting for parked fds to expire")
            time.sleep(0.1)
        end = time.monotonic() + 3
        while True:
            st = self.good_check("parked fd expiry")
            if st["parked_fds"] == base_parked or time.monotonic() > end:
                break
            time.sleep(0.1)
        check(st["parked_fds"] == base_parked, "parked_fds %d did not return to %d"
              % (st["parked_fds"], base_parked))
        check(self.srv.memfds("kvs-badinput") == 0, "server still holds the expired memfd")
        check(st["broker_expired"] == expired0 + 1, "broker_expired %d, expected %d"
              % (st["broker_expired"], expired0 + 1))
        check(st["broker_parked"] == parked0 + 1, "broker_parked %d, expected %d"
              % (st["broker_parked"], parked0 + 1))
        self.cases.append("broker: unclaimed fds expire after --fd-park-ms")

    def foreign_uid_case(self, parked):
        if os.geteuid() != 0:
            print("# SKIP foreign UID case: not running as root")
            return
        # (a) the run directory is 0700: another UID cannot even reach the socket.
        # (b) defence in depth: expose the socket inode through a hard link in a
        #     world-searchable directory with mode 0666 (a misconfiguration) and
        #     check that SO_PEERCRED still refuses the peer.
        pub = os.path.join(self.tmp, "pub")
        os.mkdir(pub)
        os.chmod(self.tmp, 0o711)
        os.chmod(pub, 0o755)
        link = os.path.join(pub, "kvside.sock")
        os.link(self.srv.sock_path, link)
        os.chmod(link, 0o666)
        child = r"""
import array, os, socket, sys
real, link = sys.argv[1], sys.argv[2]
res = []
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(real)
    res.append("real:connected")
except PermissionError:
    res.append("real:EACCES")
s.close()
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(5)
s.connect(link)
fd = os.memfd_create("foreign")
rec = b"KVSB" + (1).to_bytes(2, "little") + bytes(2) + os.urandom(32) + (4096).to_bytes(8, "little")
try:
    s.sendmsg([rec], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
except (BrokenPipeError, ConnectionResetError):
    pass
try:
    d = s.recv(64)
except ConnectionResetError:
    d = b""
res.append("link:closed" if d == b"" else "link:reply:" + d.hex())
print(" ".join(res))
"""
        try:
            out = subprocess.run([sys.executable, "-c", child, self.srv.sock_path, link],
                                 user=65534, group=65534, extra_groups=[], cwd="/",
                                 capture_output=True, timeout=20, text=True)
        finally:
            os.chmod(link, 0o600)
            os.unlink(link)
            os.rmdir(pub)
            os.chmod(self.tmp, 0o700)
        check(out.returncode == 0, "foreign UID child failed: %s" % out.stderr)
        check(out.stdout.split() == ["real:EACCES", "link:closed"],
              "foreign UID child: %r" % out.stdout)
        self.broker_check("foreign UID", parked, 1)
        self.cases.append("broker: foreign UID (EACCES on the 0700 run dir; "
                          "SO_PEERCRED refusal through an exposed link)")

    # ---- the whole run ------------------------------------------------------

    def run(self):
        self.start()
        idle = self.bconnect()  # never sends: the server drops it after its idle timeout
        self.zmq_cases()
        self.burst_case()
        self.session_expiry_case()
        self.oversized_drop_case()

        # the idle broker connection was dropped by the server (5 s idle limit)
        remaining = self.t0 + 5.5 - time.monotonic()
        while remaining > 0:
            self.good_check("waiting for the idle broker connection")
            time.sleep(min(0.2, remaining))
            remaining = self.t0 + 5.5 - time.monotonic()
        self.expect_closed(idle, "idle broker connection")
        self.cases.append("broker: idle connection dropped after its timeout")

        self.broker_cases()

        # error counters grew by exactly the error replies counted here
        st = self.good_check("all cases")
        for name in ERR_NAMES:
            got = st["errors." + name] - self.base["errors." + name]
            check(got == self.expect_err[name], "errors.%s grew by %d, expected %d"
                  % (name, got, self.expect_err[name]))
        check(st["sessions"] == self.base["sessions"], "sessions %d, expected %d"
              % (st["sessions"], self.base["sessions"]))

        # no fd leaked: as many open fds as right after start-up
        for c in self.hostiles:
            c.close()
        self.hostiles = []
        end = time.monotonic() + 5
        while True:
            self.good_check("fd count")
            n = self.srv.nfds()
            if n == self.base_fds or time.monotonic() > end:
                break
            time.sleep(0.1)
        check(n == self.base_fds, "server has %d open fds, %d after start-up: %s"
              % (n, self.base_fds, sorted(os.listdir("/proc/%d/fd" % self.srv.pid))))

        # clean shutdown
        self.good.close()
        self.srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.srv.proc.wait(5)
        except subprocess.TimeoutExpired:
            raise Fail("server did not exit within 5 s of SIGTERM")
        check(rc == 0, "server exit code %d" % rc)
        check(not os.path.exists(self.srv.sock_path), "broker socket left behind")
        check(not os.path.exists(self.srv.zmq_path), "zmq socket left behind")

    def cleanup(self):
        if self.srv:
            self.srv.kill()
        self.ctx.destroy(0)
        shutil.rmtree(self.tmp, ignore_errors=True)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    t = Test(sys.argv[1])
    try:
        t.run()
    except Exception:
        traceback.print_exc()
        print("# cases passed before the failure: %d" % len(t.cases))
        if t.srv:
            rc = t.srv.proc.poll()
            state = "alive" if rc is None else (
                "killed by signal %d" % -rc if rc < 0 else "exited with %d" % rc)
            print("# server %s; server log:\n%s" % (state, t.srv.log_text()))
        t.cleanup()
        return 1
    for i, name in enumerate(t.cases, 1):
        print("ok %d - %s" % (i, name))
    print("# %d cases, server log:\n%s" % (len(t.cases), t.srv.log_text()))
    t.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
