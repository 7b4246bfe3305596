#!/usr/bin/python3
"""The attack surfaces of docs/security.md, each attacked as the independent
run of issue 38 did, against the real server over real sockets:

  * a ZeroMQ peer that picks a routing id in the job lanes' reserved space
    (0x00 'L' 'N' + lane number), over ipc and over tcp with an authorized
    CURVE key: its messages are dropped, nothing reaches the victim's lane;
  * lanes announcing 8 MiB frames and stalling: the lanes' input is bounded
    (closed beyond 64 MiB, and after 5 s without bytes);
  * connections until the fd limit (128): new peers are shed, the server
    never aborts and its sessions are served;
  * authorized-keys: a 557-character comment line does not smuggle a key;
    a key removed from the file loses its open connection and sessions;
  * 20 slowloris connections on the metrics port: /healthz still answers;
  * KV-event replay: the ring is bounded in bytes, replays to peers that
    never read do not hold the loop (heartbeats answered), counters in stats;
  * libkvside after fork(): calls in the child fail with E_SESSION at once,
    its close leaves the parent's session alone;
  * numpy uint64 block ids above 2^63 - 1 are refused, not read as negative.

Environment as tests/python/test_binding.py."""

import array
import os
import socket
import struct
import sys
import time
import unittest

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(__file__))
import kvside  # noqa: E402
from kvt_server import Server  # noqa: E402
from test_auth import Peer, free_port  # noqa: E402

LANE_MAGIC = b"\x00LN"


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def frame(body):
    return struct.pack("<I", len(body)) + body


class Raw:
    """A raw protocol client: a DEALER, and lanes parked through the broker."""

    def __init__(self, ctx, srv, endpoint=None):
        self.srv = srv
        self.d = ctx.socket(zmq.DEALER)
        self.d.setsockopt(zmq.LINGER, 0)
        self.d.connect(endpoint or "ipc://" + os.path.join(srv.run, "kvside.zmq"))
        self.next = 0

    def call(self, msg, timeout=5.0):
        self.next += 1
        self.d.send(pack(dict(msg, v=1, id=msg.get("id", self.next))))
        if not self.d.poll(int(timeout * 1000)):
            return None
        return msgpack.unpackb(self.d.recv(), raw=False)

    def hello(self):
        rep = self.call({"op": "hello", "engine": "sec", "role": "worker", "rank": 0, "world": 1,
                         "namespace": "ns"})
        assert rep and rep["ok"], rep
        return rep["session"]

    def park(self, fd):
        token = os.urandom(16)
        rec = b"KVSB" + struct.pack("<HHH", 2, 0, 1) + bytes(6) + token + bytes(16) + struct.pack("<Q", 0)
        b = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        b.connect(os.path.join(self.srv.run, "kvside.sock"))
        b.settimeout(5)
        b.sendmsg([rec], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        rep = b.recv(64)
        b.close()
        assert rep[:4] == b"KVSR" and struct.unpack("<i", rep[4:8])[0] == 0, rep
        return token

    def lane(self, session):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = self.park(theirs.fileno())
        theirs.close()
        rep = self.call({"op": "lane", "session": session, "token": token})
        assert rep and rep["ok"], rep
        return ours

    def stat(self, name):
        rep = self.call({"op": "stats"})
        return rep["counters"][name]

    def close(self):
        self.d.close(0)


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class SecurityTest(unittest.TestCase):
    def setUp(self):
        self.ctx = zmq.Context()
        self.srv = None

    def tearDown(self):
        self.ctx.destroy(linger=0)
        if self.srv:
            rc = self.srv.stop()
            log = self.srv.log()
            self.srv.cleanup()
            self.assertEqual(rc, 0, log[-3000:])

    def start(self, *extra, **kw):
        self.srv = Server(*extra, prefix="kvt-sec-", **kw)
        self.srv.start()
        return self.srv

    def assert_nothing_on(self, sock, secs=1.0):
        sock.settimeout(secs)
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            return
        self.fail("the victim's lane received %d bytes: %r" % (len(data), data[:200]))

    def spoof(self, attacker_endpoint, curve=None):
        """A victim with a lane (lane number 1), an attacker whose routing id
        names that lane; returns (attacker's replies, victim's lane socket)."""
        victim = Raw(self.ctx, self.srv)
        vs = victim.hello()
        lane = victim.lane(vs)
        atks = []
        for number in range(1, 5):  # lane numbers count from 1 (the start-up probe took one)
            atk = self.ctx.socket(zmq.DEALER)
            atk.setsockopt(zmq.LINGER, 0)
            atk.setsockopt(zmq.ROUTING_ID, LANE_MAGIC + struct.pack("<Q", number) + b"evil")
            if curve:
                server_pub, (pub, sec) = curve
                atk.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
                atk.setsockopt(zmq.CURVE_PUBLICKEY, pub)
                atk.setsockopt(zmq.CURVE_SECRETKEY, sec)
            atk.connect(attacker_endpoint)
            atk.send(pack({"v": 1, "op": "hello", "id": 4242, "engine": "x", "role": "scheduler", "rank": 0,
                           "world": 1, "namespace": "ns"}))
            atk.send(pack({"v": 1, "op": "lookup", "id": 77, "session": vs, "keys": [bytes(32)]}))
            atks.append(atk)
        self.assert_nothing_on(lane)
        for atk in atks:
            self.assertFalse(atk.poll(100), "the attacker got a reply")
            atk.close(0)
        self.assertGreaterEqual(victim.stat("lane_ident_spoofs"), 8)
        # the victim's lane still serves its own session
        lane.sendall(frame(pack({"v": 1, "op": "heartbeat", "id": 9, "session": vs})))
        lane.settimeout(5)
        rep = lane.recv(1 << 16)
        self.assertEqual(msgpack.unpackb(rep[4:], raw=False)["id"], 9)
        victim.close()
        lane.close()

    def test_lane_ident_forged_over_ipc(self):
        srv = self.start()
        self.spoof("ipc://" + os.path.join(srv.run, "kvside.zmq"))

    def test_lane_ident_forged_over_tcp_with_curve(self):
        port = free_port()
        self.srv = Server(prefix="kvt-sec-")
        keys = os.path.join(self.srv.tmp, "authorized_keys")
        tenant = zmq.curve_keypair()
        with open(keys, "w") as f:
            f.write(tenant[0].decode() + "\n")
        state = os.path.join(self.srv.tmp, "state")
        self.srv.extra = ["--listen", "tcp://127.0.0.1:%d" % port, "--state-dir", state, "--authorized-keys", keys]
        self.srv.start()
        with open(os.path.join(state, "server.key")) as f:
            server_pub = f.read().split()[0].encode()
        self.spoof("tcp://127.0.0.1:%d" % port, curve=(server_pub, tenant))

    def test_lane_input_is_bounded(self):
        srv = self.start(ttl_ms=20000)  # the sessions outlive the 5 s stall
        r = Raw(self.ctx, srv)
        lanes = []
        for _ in range(48):
            lanes.append(r.lane(r.hello()))
        rss0 = peak = rss_kib(srv.proc.pid)
        chunk = b"\x01" * (1 << 20)
        for s in lanes:
            s.setblocking(True)
            s.settimeout(5)
            try:
                s.sendall(struct.pack("<I", (8 << 20) + 4096))
                for _ in range(8):
                    s.sendall(chunk)
            except OSError:
                pass  # closed by the server: the point
            peak = max(peak, rss_kib(srv.proc.pid))
        time.sleep(0.3)
        peak = max(peak, rss_kib(srv.proc.pid))
        closed = r.stat("lanes_closed_budget")
        big = r.stat("lane_input_big_bytes")
        # 64 MiB of large frames in progress at most, plus one frame
        self.assertLessEqual(big, (64 << 20) + (8 << 20) + 8192)
        self.assertGreaterEqual(closed, 48 - 9)
        self.assertLess(peak - rss0, 160 << 10, "RSS grew by %d KiB" % (peak - rss0))
        # the stalled ones go after 5 s without bytes
        deadline = time.time() + 10
        while r.stat("lane_input_big_bytes") and time.time() < deadline:
            time.sleep(0.2)
        self.assertEqual(r.stat("lane_input_big_bytes"), 0)
        self.assertGreaterEqual(r.stat("lanes_closed_stalled"), 1)
        for s in lanes:
            s.close()
        r.close()

    def test_fd_limit_sheds_peers_and_never_aborts(self):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 4096 and hard >= 4096:
            resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
        srv = Server(prefix="kvt-sec-")
        self.srv = srv
        wrapper = os.environ.get("KVT_SERVER_WRAPPER", "")
        os.environ["KVT_SERVER_WRAPPER"] = ("prlimit --nofile=128:128 " + wrapper).strip()
        try:
            srv.start()
        finally:
            os.environ["KVT_SERVER_WRAPPER"] = wrapper
        keeper = Raw(self.ctx, srv)
        ks = keeper.hello()
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 4096)
        flood = []
        try:
            # clients with lanes until the broker refuses, then bare connections
            for _ in range(40):
                c = Raw(ctx, srv)
                flood.append(c)
                rep = c.call({"op": "hello", "engine": "f", "role": "worker", "rank": 0, "world": 1,
                              "namespace": "ns"}, timeout=2)
                if not rep or not rep["ok"]:
                    break
                try:
                    c.lane(rep["session"])
                except (AssertionError, OSError):
                    break
            for _ in range(200):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect("ipc://" + os.path.join(srv.run, "kvside.zmq"))
                d.send(pack({"v": 1, "op": "heartbeat", "id": 1, "session": 1}))
                flood.append(d)
            time.sleep(1.0)
            self.assertIsNone(srv.proc.poll(), "the server died:\n" + srv.log()[-3000:])
            rep = keeper.call({"op": "heartbeat", "session": ks})
            self.assertTrue(rep and rep["ok"], rep)
            self.assertGreater(keeper.stat("accepts_shed"), 0)
        finally:
            for f in flood:
                f.close() if isinstance(f, Raw) else f.close(0)
            ctx.destroy(linger=0)
        # the limit passed, new peers are served again
        time.sleep(0.5)
        fresh = Raw(self.ctx, srv)
        self.assertTrue(fresh.hello())
        fresh.close()
        keeper.close()

    def curve_server(self, key_text):
        port = free_port()
        self.srv = Server(prefix="kvt-sec-")
        keys = os.path.join(self.srv.tmp, "authorized_keys")
        with open(keys, "w") as f:
            f.write(key_text)
        state = os.path.join(self.srv.tmp, "state")
        self.srv.extra = ["--listen", "tcp://127.0.0.1:%d" % port, "--state-dir", state, "--authorized-keys", keys]
        self.srv.start()
        with open(os.path.join(state, "server.key")) as f:
            server_pub = f.read().split()[0].encode()
        return "tcp://127.0.0.1:%d" % port, server_pub, keys

    def test_long_comment_line_admits_no_key(self):
        legit, smuggled = zmq.curve_keypair(), zmq.curve_keypair()
        line = "#" + "x" * 510 + smuggled[0].decode() + " admin\n"
        self.assertEqual(len(line), 558)
        ep, server_pub, _ = self.curve_server(legit[0].decode() + "\n" + line)
        p = Peer(self.ctx, ep, server_pub, smuggled)
        self.assertIsNone(p.hello(), "the key in the comment was admitted")
        p.close()
        ok = Peer(self.ctx, ep, server_pub, legit)
        self.assertTrue(ok.hello()["ok"])
        ok.close()

    def test_removed_key_loses_its_connection(self):
        keep, gone = zmq.curve_keypair(), zmq.curve_keypair()
        ep, server_pub, keys = self.curve_server("%s\n%s\n" % (keep[0].decode(), gone[0].decode()))
        a, b = Peer(self.ctx, ep, server_pub, keep), Peer(self.ctx, ep, server_pub, gone)
        sa, sb = a.hello()["session"], b.hello()["session"]
        self.assertTrue(b.call("heartbeat", session=sb)["ok"])
        with open(keys + ".new", "w") as f:
            f.write(keep[0].decode() + "\n")
        os.rename(keys + ".new", keys)
        time.sleep(1.5)  # one re-read (1 s)
        rep = b.call("heartbeat", session=sb)
        self.assertTrue(rep and not rep["ok"] and rep["code"] == "E_AUTH", rep)
        st = a.call("stats", session=sa)["counters"]
        self.assertEqual(st["sessions"], 1, "the removed key's session is closed (a's is left)")
        self.assertGreaterEqual(st["auth_revoked"], 1)
        self.assertTrue(a.call("heartbeat", session=sa)["ok"])
        a.close()
        b.close()

    def test_healthz_under_slowloris(self):
        port = free_port()
        srv = self.start("--metrics-listen", "127.0.0.1:%d" % port)
        slow = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        answered = 0
        t_end = time.time() + 8
        for i in range(7):
            for s in slow:  # a header line every ~1 s keeps MHD's idle time-out away
                try:
                    s.sendall(b"X-%d: y\r\n" % i)
                except OSError:
                    pass
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as p:
                    p.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if p.recv(64).startswith(b"HTTP/1.1 200"):
                        answered += 1
            except OSError:
                pass
            time.sleep(max(0.0, min(1.0, t_end - time.time())))
        self.assertEqual(answered, 7)
        r = Raw(self.ctx, srv)
        self.assertGreaterEqual(r.stat("metrics_conns_cut"), 20, "the 5 s deadline cut the slow ones")
        r.close()
        for s in slow:
            s.close()

    def fill_events(self, c, secs, keys_per_job, pause):
        job = 0
        t_end = time.time() + secs
        while time.time() < t_end:  # many ticks of stores (and L1 evictions)
            job += 1
            keys = [os.urandom(32) for _ in range(keys_per_job)]
            base = (job * keys_per_job) % (256 - keys_per_job)
            c.store(job, keys, [list(range(base, base + keys_per_job))])
            c.complete(job)
            # the copies run after complete's reply: without the wait, jobs
            # in flight hold L1 reserved and a store finds no room (E_NOSPACE)
            c.job_wait(job, timeout_ms=5000)
            if pause:
                time.sleep(pause)

    def events_server(self, *extra):
        srv = self.srv = Server(prefix="kvt-sec-", l1_size="4M")
        pub = "ipc://" + os.path.join(srv.tmp, "ev.pub")
        replay = "ipc://" + os.path.join(srv.tmp, "ev.replay")
        srv.extra = ["--kv-events", pub, "--kv-events-replay", replay] + list(extra)
        srv.start()
        mem = kvside.HostMemory(256 * 4096)
        c = kvside.Client("ev", "ns", rank=0, world=1, broker_dir=srv.run, timeout_ms=5000)
        c.register_memory([mem], groups=[kvside.Group(0, "attention", 16, 1)],
                          layers=[kvside.Layer(0, 0, 0, 256, 4096, 4096)])
        return srv, replay, mem, c

    def test_replay_flood(self):
        # a ring of tens of MiB (the default bounds), then 4 replay peers
        # that never read, 3 requests each: the replays share the ring's
        # payloads (36206b5 copied the whole ring per request in one pass)
        srv, replay, mem, c = self.events_server()
        self.fill_events(c, 4, 128, 0)
        st = c.stats()
        ring = st["kv_events_ring_bytes"]
        self.assertGreater(ring, 8 << 20, "the ring holds %d bytes" % ring)
        rss0 = rss_kib(srv.proc.pid)
        flood = []
        for _ in range(4):
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.connect(replay)
            for _ in range(3):
                d.send_multipart([b"", (0).to_bytes(8, "big")])
            flood.append(d)
        hb = Raw(self.ctx, srv)
        hs = hb.hello()
        peak = rss0
        for _ in range(40):
            rep = hb.call({"op": "heartbeat", "session": hs}, timeout=3.0)
            self.assertTrue(rep and rep["ok"], "a heartbeat went unanswered during the replay flood")
            peak = max(peak, rss_kib(srv.proc.pid))
            time.sleep(0.02)
        grown = (peak - rss0) << 10
        self.assertLess(grown, 2 * ring, "RSS grew %d bytes for 12 replays of a %d-byte ring" % (grown, ring))
        # a reader gets every kept batch in order, then the end marker
        r = self.ctx.socket(zmq.DEALER)
        r.setsockopt(zmq.LINGER, 0)
        r.connect(replay)
        r.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            self.assertTrue(r.poll(5000), "replay did not end")
            f = r.recv_multipart()
            if f[2] == b"\xff" * 8:
                break
            seqs.append(int.from_bytes(f[2], "big"))
        self.assertTrue(seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs[:10])
        st = c.stats()
        self.assertGreaterEqual(st["kv_events_replay_requests"], 13)
        self.assertGreaterEqual(st["kv_events_replays"], 1)
        for d in flood:
            d.close(0)
        r.close(0)
        hb.close()
        c.close()
        mem.close()

    def test_replay_ring_is_bounded_in_bytes(self):
        srv, replay, mem, c = self.events_server("--kv-events-buffer-bytes", "64K")
        self.fill_events(c, 2, 4, 0.003)  # small batches: each tick's under the bound
        st = c.stats()
        self.assertLessEqual(st["kv_events_ring_bytes"], 64 << 10)
        self.assertGreater(st["kv_events_ring_dropped"], 0)
        self.assertGreater(st["kv_events_ring_batches"], 0)
        c.close()
        mem.close()

    def test_fork_child_cannot_use_the_parents_client(self):
        srv = self.start()
        c = kvside.Client("fork", "ns", role="scheduler", broker_dir=srv.run, timeout_ms=3000)
        session = c.session
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(rd)
                t0 = time.time()
                try:
                    c.lookup([bytes(32)], timeout_ms=1000)
                    code = 10
                except kvside.KvsideError as e:
                    if "E_SESSION" not in str(e):
                        code = 11
                if time.time() - t0 > 1.5:
                    code = 12
                c.close()
                os.write(wr, b"done")
            except BaseException:
                code = 13
            os._exit(code)
        os.close(wr)
        deadline = time.time() + 10
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the forked child hung in the client")
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        self.assertEqual(os.read(rd, 16), b"done")
        os.close(rd)
        # the parent's session is untouched
        self.assertEqual(c.session, session)
        self.assertEqual(c.lookup([bytes(32)]).hits, 0)
        self.assertEqual(c.stats()["sessions_opened"], 2, "probe + parent: no re-open")
        c.close()

    def test_uint64_block_ids_above_int64_refused(self):
        try:
            import numpy
        except ImportError:
            self.skipTest("numpy not installed")
        srv = self.start()
        mem = kvside.HostMemory(16 * 4096)
        c = kvside.Client("u64", "ns", rank=0, world=1, broker_dir=srv.run, timeout_ms=3000)
        c.register_memory([mem], groups=[kvside.Group(0, "attention", 16, 1)],
                          layers=[kvside.Layer(0, 0, 0, 16, 4096, 4096)])
        for ids in (numpy.array([2 ** 64 - 1], dtype=numpy.uint64), array.array("Q", [2 ** 63])):
            with self.assertRaises(ValueError):
                c.store(1, [bytes(32)], [ids])
        self.assertEqual(c.stats()["jobs_open"], 0, "nothing was sent")
        c.store(2, [bytes(32)], [numpy.array([3], dtype=numpy.uint64)])
        c.complete(2)
        self.assertEqual(c.job_wait(2, 5000), "committed")
        c.close()
        mem.close()


if __name__ == "__main__":
    unittest.main()
