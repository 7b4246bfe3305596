#!/usr/bin/python3
"""Bounded memory per peer (issue 16 #4, protocol §1): three peers that send
requests and never read their replies make the server hold at most
max-peer-queue bytes each (default 8 MiB); past it they are cut off and their sessions
closed, the server's RSS grows by less than 64 MiB, and a well-behaved client
is served throughout.

Real server; the three peers are raw ZeroMQ DEALER sockets (pyzmq, msgpack)
with tiny receive buffers. Environment as tests/python/test_binding.py."""

import os
import time
import unittest

import kvside
from kvt_server import Server

try:
    import msgpack
    import zmq
except ImportError:  # not on the GPU image
    zmq = None


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@unittest.skipIf(zmq is None, "pyzmq/msgpack not installed")
class SlowPeersTest(unittest.TestCase):
    def test_peers_that_never_read(self):
        srv = Server(ttl_ms=60000, heartbeat_ms=1000)  # default max-peer-queue: 8 MiB
        srv.start()
        ctx = zmq.Context()
        good = kvside.Client("good", "ns", role="scheduler", broker_dir=srv.run, timeout_ms=5000)
        try:
            good.stats()
            rss0 = rss_kib(srv.proc.pid)
            peers = []
            for i in range(3):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
                s.setsockopt(zmq.SNDHWM, 0)
                s.connect("ipc://" + os.path.join(srv.run, "kvside.zmq"))
                s.send(msgpack.packb({"v": 1, "op": "hello", "id": 1, "engine": "slow%d" % i,
                                      "role": "scheduler", "rank": 0, "world": 1, "namespace": "ns"}))
                # the hello reply is the only one read: its session id
                rep = msgpack.unpackb(s.recv(), raw=False)
                self.assertTrue(rep["ok"])
                peers.append((s, rep["session"]))
            # every stats reply is several KiB: 20,000 of them per peer is far
            # beyond 8 MiB; none is read
            for n in range(20000):
                for s, sid in peers:
                    s.send(msgpack.packb({"v": 1, "op": "stats", "id": 10 + n, "session": sid}))
                if n % 2000 == 0:
                    good.stats()  # served throughout
            deadline = time.time() + 30
            st = good.stats()
            while st["peers_cut_off"] < 3 and time.time() < deadline:
                time.sleep(0.2)
                st = good.stats()
            self.assertEqual(st["peers_cut_off"], 3, st)
            self.assertLessEqual(st["sessions"], 1, "the slow peers' sessions were closed")
            grown = (rss_kib(srv.proc.pid) - rss0) / 1024
            self.assertLess(grown, 64, "server RSS grew by %.1f MiB" % grown)
            self.assertLessEqual(st["reply_bytes_queued"], 3 * (8 << 20))
        finally:
            for s, _ in locals().get("peers", []):
                s.close(0)
            good.close()
            ctx.term()
            srv.stop()
        self.assertIn("stopped reading its replies", srv.log())


if __name__ == "__main__":
    unittest.main()
