#!/usr/bin/python3
"""Chaos 6: three peers that never read their replies (issue 16 #4), as in
tests/python/test_slow_peers.py, while a rank process keeps storing and
retrieving. Each slow peer floods the server with 20,000 stats requests (a
few KiB of reply each, ~100 MiB per peer if queued) and reads nothing. The
server's RSS must grow by less than 64 MiB, the three peers must be cut off
(peers_cut_off) and their sessions closed, and the good client and the rank
must be served throughout: 0 wrong bytes, every request by its deadline."""

import os
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, rss_kib, tail

try:
    import msgpack
    import zmq
except ImportError:  # not on the GPU image
    zmq = None

NS = "chaos-slow"
REQUESTS = 20000
PEERS = 3


@unittest.skipIf(zmq is None, "pyzmq/msgpack not installed")
class SlowPeersTest(unittest.TestCase):
    def test_three_peers_that_never_read(self):
        srv = Server(l1_size="16M", ttl_ms=60000, heartbeat_ms=1000, prefix="kvt-chaos-slow-")
        srv.start()
        ctx = zmq.Context()
        dl = Deadlines()
        rank = good = None
        peers = []
        with Scenario("slow_peers", "%d peers that send %d stats requests each and never read a reply" % (
                PEERS, REQUESTS)) as sc:
            try:
                good = kvside.Client("good", NS, role="scheduler", broker_dir=srv.run, timeout_ms=2000)
                rank = Rank(srv, "slow-rank", NS, 0, 1, blocks=256, block_bytes=16 << 10, bpc=2)
                # L1 (16 MiB) filled once, so that its pages are in the RSS before the baseline
                for j in range(40):
                    r = rank.do("store", job=1 + j, prompt=1 + j, n=16)
                    self.assertEqual(r.get("final"), "committed", r)
                rss0 = rss_kib(srv.proc.pid)
                for i in range(PEERS):
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.RCVHWM, 1)
                    s.setsockopt(zmq.RCVBUF, 4096)
                    s.setsockopt(zmq.SNDHWM, 0)
                    s.connect("ipc://" + os.path.join(srv.run, "kvside.zmq"))
                    s.send(msgpack.packb({"v": 1, "op": "hello", "id": 1, "engine": "slow%d" % i,
                                          "role": "scheduler", "rank": 0, "world": 1, "namespace": NS}))
                    rep = msgpack.unpackb(s.recv(), raw=False)  # the only reply read
                    self.assertTrue(rep["ok"])
                    peers.append((s, rep["session"]))
                # the rank stores through the flood
                rank.send("loop", job0=1000, prompt0=1000, n=16, timeout_ms=5000)
                t0 = time.monotonic()
                good_lat = []
                rss_max = rss0
                for n in range(REQUESTS):
                    for s, sid in peers:
                        s.send(msgpack.packb({"v": 1, "op": "stats", "id": 10 + n, "session": sid}))
                    if n % 1000 == 0:
                        t = time.monotonic()
                        _, e = dl.call("stats", 2000, good.stats)
                        self.assertIsNone(e, "the good client was not served: %s" % e)
                        good_lat.append((time.monotonic() - t) * 1000)
                        rss_max = max(rss_max, rss_kib(srv.proc.pid))
                sent_s = time.monotonic() - t0
                deadline = time.monotonic() + 30
                st, _ = dl.call("stats", 2000, good.stats)
                while st.get("peers_cut_off", 0) < PEERS and time.monotonic() < deadline:
                    time.sleep(0.2)
                    rss_max = max(rss_max, rss_kib(srv.proc.pid))
                    st, _ = dl.call("stats", 2000, good.stats)
                rank.send("stop")
                res = rank.recv()
                dl.merge(res["dl"])
                jobs = res["jobs"]
                committed = [j for j in jobs if j.get("final") == "committed"]
                wrong = 0
                for i, j in enumerate(committed[-3:]):
                    r = rank.do("retrieve", job=900000 + i, prompt=j["job"], n=16)
                    dl.merge(r["dl"])
                    self.assertEqual(r["retrieve"], "open", r)
                    wrong += r["wrong_bytes"]
                rss_max = max(rss_max, rss_kib(srv.proc.pid))
                grown = (rss_max - rss0) / 1024
                sc.load = "%d x %d stats requests in %.1f s (%.0f requests/s) + a rank storing %d jobs of 512 KiB" % (
                    PEERS, REQUESTS, sent_s, PEERS * REQUESTS / sent_s, len(jobs))
                sc.numbers.update({
                    "rss_growth_mib": round(grown, 1), "peers_cut_off": st.get("peers_cut_off"),
                    "sessions_left": st.get("sessions"), "reply_bytes_queued": st.get("reply_bytes_queued"),
                    "good_client_stats_ms_max": round(max(good_lat), 1), "rank_jobs": len(jobs),
                    "rank_jobs_committed": len(committed), "wrong_bytes": wrong,
                    "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "the slow peers' replies and sessions (cut off); nothing of other clients"
                self.assertEqual(st.get("peers_cut_off", 0), PEERS, "slow peers not cut off: %s%s" % (
                    {k: st.get(k) for k in ("peers_cut_off", "sessions", "reply_bytes_queued")}, tail(srv)))
                # the good client, the probe-free rank: the slow ones are gone
                self.assertLessEqual(st["sessions"], 2, "the slow peers' sessions were not closed")
                self.assertLess(grown, 64, "server RSS grew by %.1f MiB" % grown)
                self.assertEqual(len(committed), len(jobs), "rank jobs failed during the flood")
                self.assertGreater(len(committed), 0)
                self.assertEqual(wrong, 0)
                self.assertEqual(dl.late, [], "requests answered after their deadline")
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                for s, _ in peers:
                    s.close(0)
                if rank:
                    rank.close()
                if good:
                    good.close()
                ctx.term()
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
