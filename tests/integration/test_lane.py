#!/usr/bin/python3
"""Job lanes (protocol.md §18) against the real server, spoken raw.

A lane is one end of an AF_UNIX stream socket pair, parked in the fd broker
and claimed with a `lane` request over ZeroMQ; its frames are a 4-byte
little-endian length and one msgpack message. Cases:

  * attach, then requests and their replies over the lane, in order (50
    requests in one write: their replies leave in one write too, the loop
    iteration's, counted in lane_writes), among them a 4,096-key lookup
    (larger than a socket buffer) and a message just above the size limit
    (E_LIMIT, lane kept);
  * a lane that is not read: the replies the socket cannot take go to the
    session's DEALER instead, each request answered exactly once;
  * hostile attaches: unknown token, a memfd, a datagram socket, an attach
    over a lane, an unknown session; a second attach replaces the first;
  * hostile frames: length 0, a length above the limit (lane closed, session
    kept), bytes that are not msgpack (E_BADMSG, lane kept);
  * bye over the lane answers on it and closes it; an expired session closes
    its lane; at the end the server has as many fds as after start-up.

Usage: test_lane.py /path/to/kvside-server
"""

import array
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import shutil

import msgpack
import zmq

TTL_MS = 1500
MAX_MSG = 8 << 20
TIMEOUT = 5.0


class Fail(AssertionError):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def frame(body):
    return struct.pack("<I", len(body)) + body


class Lane:
    """Our end of a lane: frames out, frames in."""

    def __init__(self, sock):
        self.sock = sock
        self.sock.settimeout(TIMEOUT)
        self.buf = b""

    def send(self, msg):
        self.sock.sendall(frame(pack(msg)))

    def send_raw(self, data):
        self.sock.sendall(data)

    def recv(self):
        while True:
            if len(self.buf) >= 4:
                n = struct.unpack("<I", self.buf[:4])[0]
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return msgpack.unpackb(body, raw=False)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise Fail("lane closed while a reply was expected")
            self.buf += chunk

    def closed(self):
        """True once the server closed its end (nothing more to read)."""
        try:
            self.sock.settimeout(TIMEOUT)
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    return True
                self.buf += chunk
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True


class T:
    def __init__(self, exe):
        self.tmp = tempfile.mkdtemp(prefix="kvs-lane-")
        self.run = os.path.join(self.tmp, "run")
        self.log = open(os.path.join(self.tmp, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [exe, "--broker-dir", self.run, "--ttl-ms", str(TTL_MS), "--heartbeat-ms", "300",
             "--l1-size", "64M", "--no-prefault", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.ctx = zmq.Context()
        self.next_id = 1
        deadline = time.time() + 10
        while not os.path.exists(os.path.join(self.run, "kvside.sock")):
            check(time.time() < deadline and self.proc.poll() is None, "server did not start")
            time.sleep(0.02)
        self.dealer = self.new_dealer()
        self.session = self.hello(self.dealer)

    def nfds(self):
        return len(os.listdir("/proc/%d/fd" % self.proc.pid))

    def new_dealer(self):
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect("ipc://" + os.path.join(self.run, "kvside.zmq"))
        return d

    def rid(self):
        self.next_id += 1
        return self.next_id

    def call(self, dealer, msg):
        msg = dict(msg, v=1, id=msg.get("id") or self.rid())
        dealer.send(pack(msg))
        return self.recv(dealer)

    @staticmethod
    def recv(dealer, timeout=TIMEOUT):
        if not dealer.poll(int(timeout * 1000), zmq.POLLIN):
            raise Fail("no reply on the DEALER")
        return msgpack.unpackb(dealer.recv(), raw=False)

    def hello(self, dealer):
        rep = self.call(dealer, {"op": "hello", "engine": "lane-test", "role": "worker", "rank": 0,
                                 "world": 1, "namespace": "ns"})
        check(rep["ok"], "hello: %r" % rep)
        return rep["session"]

    def park(self, fd):
        """Parks fd in the broker; returns its token."""
        token = os.urandom(16)
        rec = b"KVSB" + struct.pack("<HHH", 2, 0, 1) + bytes(6) + token + bytes(16) + \
            struct.pack("<Q", 0)
        b = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        b.connect(os.path.join(self.run, "kvside.sock"))
        b.settimeout(TIMEOUT)
        b.sendmsg([rec], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        rep = b.recv(64)
        b.close()
        check(rep[:4] == b"KVSR" and struct.unpack("<i", rep[4:8])[0] == 0, "park: %r" % rep)
        return token

    def attach(self, dealer, session, expect=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = self.park(theirs.fileno())
        theirs.close()
        rep = self.call(dealer, {"op": "lane", "session": session, "token": token})
        if expect:
            check(not rep["ok"] and rep["code"] == expect, "attach: want %s, got %r" % (expect, rep))
            ours.close()
            return None
        check(rep["ok"] and rep["op"] == "lane", "attach: %r" % rep)
        return Lane(ours)

    def stat(self, name):
        rep = self.call(self.dealer, {"op": "stats"})
        check(name in rep["counters"], "no counter %s" % name)
        return rep["counters"][name]

    # ---- cases ------------------------------------------------------------------

    def requests_in_order(self):
        lane = self.attach(self.dealer, self.session)
        check(self.stat("lanes_open") == 1, "lanes_open")
        ids = [self.rid() for _ in range(50)]
        w0, r0 = self.stat("lane_writes"), self.stat("lane_replies")
        lane.send_raw(b"".join(frame(pack({"v": 1, "op": "heartbeat", "id": i, "session": self.session}))
                               for i in ids))
        got = [lane.recv() for _ in ids]
        check([r["id"] for r in got] == ids, "replies out of order: %r" % [r["id"] for r in got])
        # the loop read the 50 in one go (two, if the read split them) and
        # wrote their replies together at the end of that iteration
        writes, replies = self.stat("lane_writes") - w0, self.stat("lane_replies") - r0
        check(replies == 50 and 1 <= writes <= 2, "50 replies in %d writes (%d replies counted)" % (writes, replies))
        check(all(r["ok"] and r["op"] == "heartbeat" for r in got), "heartbeats failed")
        # larger than a socket buffer: the server reads it in pieces
        keys = [os.urandom(32) for _ in range(4096)]
        i = self.rid()
        lane.send({"v": 1, "op": "lookup", "id": i, "session": self.session, "keys": keys})
        rep = lane.recv()
        check(rep["id"] == i and rep["ok"] and rep["hits"] == 0, "big lookup: %r" % rep)
        # just above the limit: E_LIMIT, as on ZeroMQ, and the lane stays
        i = self.rid()
        body = pack({"v": 1, "op": "heartbeat", "id": i, "session": self.session,
                     "pad": b"x" * (MAX_MSG + 16)})
        check(MAX_MSG < len(body) <= MAX_MSG + 4096, "size %d" % len(body))
        lane.send_raw(frame(body))
        rep = lane.recv()
        check(rep["id"] == i and not rep["ok"] and rep["code"] == "E_LIMIT", "oversize: %r" % rep)
        # not msgpack: E_BADMSG on the lane, lane kept
        lane.send_raw(frame(b"\xc1\xc1\xc1"))
        rep = lane.recv()
        check(not rep["ok"] and rep["code"] == "E_BADMSG", "garbage: %r" % rep)
        i = self.rid()
        lane.send({"v": 1, "op": "heartbeat", "id": i, "session": self.session})
        check(lane.recv()["id"] == i, "lane after errors")
        check(self.stat("lane_requests") >= 54, "lane_requests")
        return lane

    def unread_lane_diverts(self, lane):
        d0 = self.stat("lane_replies_diverted")
        ids = [self.rid() for _ in range(400)]
        for i in ids:  # stats replies are ~6 KB: 400 of them fill the socket
            lane.send({"v": 1, "op": "stats", "id": i, "session": self.session})
        # the server answers them all; what the lane cannot take comes here.
        # Let the lane fill before reading it, then read both paths until
        # every request is answered (slow builds: ASan, valgrind)
        time.sleep(0.5)
        zmq_ids, lane_ids = [], []
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(lane.sock.fileno(), zmq.POLLIN)
        deadline = time.time() + 30
        while len(lane_ids) + len(zmq_ids) < len(ids) and time.time() < deadline:
            ev = dict(poller.poll(500))
            if self.dealer in ev:
                zmq_ids.append(msgpack.unpackb(self.dealer.recv(), raw=False)["id"])
            if lane.sock.fileno() in ev or len(lane.buf) >= 4:
                lane_ids.append(lane.recv()["id"])
        check(zmq_ids, "no reply was diverted to the DEALER")
        check(sorted(lane_ids + zmq_ids) == ids, "each request answered exactly once: %d on the lane, %d on "
              "ZeroMQ of %d" % (len(lane_ids), len(zmq_ids), len(ids)))
        check(self.stat("lane_replies_diverted") - d0 == len(zmq_ids), "lane_replies_diverted")

    def hostile_attaches(self, lane):
        # unknown token
        rep = self.call(self.dealer, {"op": "lane", "session": self.session, "token": os.urandom(16)})
        check(not rep["ok"] and rep["code"] == "E_AUTH", "unknown token: %r" % rep)
        # a memfd, a datagram socket: refused, the fd is not kept
        fds0 = self.nfds()
        mfd = os.memfd_create("not-a-socket")
        tok = self.park(mfd)
        os.close(mfd)
        rep = self.call(self.dealer, {"op": "lane", "session": self.session, "token": tok})
        check(not rep["ok"] and rep["code"] == "E_BADMSG", "memfd: %r" % rep)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        tok = self.park(b.fileno())
        b.close()
        rep = self.call(self.dealer, {"op": "lane", "session": self.session, "token": tok})
        check(not rep["ok"] and rep["code"] == "E_BADMSG", "dgram: %r" % rep)
        a.close()
        check(self.nfds() == fds0, "refused fds kept: %d -> %d" % (fds0, self.nfds()))
        # the token was consumed: a second claim fails
        rep = self.call(self.dealer, {"op": "lane", "session": self.session, "token": tok})
        check(not rep["ok"] and rep["code"] == "E_AUTH", "token reuse: %r" % rep)
        # an unknown session
        rep = self.call(self.dealer, {"op": "lane", "session": 12345, "token": os.urandom(16)})
        check(not rep["ok"] and rep["code"] == "E_SESSION", "unknown session: %r" % rep)
        # over a lane: refused on the lane, the lane stays
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        tok = self.park(theirs.fileno())
        theirs.close()
        i = self.rid()
        lane.send({"v": 1, "op": "lane", "id": i, "session": self.session, "token": tok})
        rep = lane.recv()
        check(rep["id"] == i and not rep["ok"] and rep["code"] == "E_BADMSG", "lane over lane: %r" % rep)
        ours.close()
        # a second attach replaces the first, which the server closes
        lane2 = self.attach(self.dealer, self.session)
        check(lane.closed(), "the replaced lane was not closed")
        check(self.stat("lanes_open") == 1, "lanes_open after a replace")
        return lane2

    def hostile_frames(self):
        for what, data in (("length 0", struct.pack("<I", 0)),
                           ("length above the limit", struct.pack("<I", MAX_MSG + 4097) + b"\x80")):
            d = self.new_dealer()
            s = self.hello(d)
            lane = self.attach(d, s)
            bad0 = self.stat("lanes_closed_bad")
            lane.send_raw(data)
            check(lane.closed(), "%s: lane not closed" % what)
            check(self.stat("lanes_closed_bad") == bad0 + 1, "%s: lanes_closed_bad" % what)
            rep = self.call(d, {"op": "heartbeat", "session": s})
            check(rep["ok"], "%s: the session did not survive: %r" % (what, rep))
            self.call(d, {"op": "bye", "session": s})
            d.close(0)

    def bye_and_expiry(self, lane):
        # bye over the lane: its reply on the lane, then the lane closes
        i = self.rid()
        lane.send({"v": 1, "op": "bye", "id": i, "session": self.session})
        rep = lane.recv()
        check(rep["id"] == i and rep["ok"], "bye: %r" % rep)
        check(lane.closed(), "bye did not close the lane")
        # an expired session takes its lane along
        d = self.new_dealer()
        s = self.hello(d)
        lane = self.attach(d, s)
        time.sleep(TTL_MS / 1000.0 + 0.5)
        check(lane.closed(), "the expired session's lane is open")
        d.close(0)
        self.session = self.hello(self.dealer)
        check(self.stat("lanes_open") == 0, "lanes_open at the end")

    def main(self):
        fds0 = self.nfds()
        lane = self.requests_in_order()
        self.unread_lane_diverts(lane)
        lane = self.hostile_attaches(lane)
        self.hostile_frames()
        self.bye_and_expiry(lane)
        time.sleep(0.2)
        check(self.nfds() == fds0, "server fds: %d after start, %d now" % (fds0, self.nfds()))
        check(self.proc.poll() is None, "server died")

    def cleanup(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            rc = self.proc.wait(30)
            check(rc == 0, "server exit %d" % rc)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def main():
    t = T(sys.argv[1])
    try:
        t.main()
        t.cleanup()
    except Exception:
        with open(os.path.join(t.tmp, "server.log"), "rb") as f:
            sys.stderr.write(f.read().decode("utf-8", "replace")[-4000:])
        raise
    print("lane: all cases passed")


if __name__ == "__main__":
    main()
