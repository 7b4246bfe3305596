#!/usr/bin/python3
"""Chaos 1: L2 map full under steady stores (issue 16 #1). A 64 MiB L2 of
32 KiB objects under a store loop fills its map within seconds and then
lives full: the writer must evict and keep committing in every 5 s window,
with no write errors after the first window, and again after a restart.
0 wrong bytes served, every request answered by its deadline."""

import os
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, keys_of, stat_delta, tail

NS = "chaos-mapfull"
WINDOW_S = 5
WINDOWS = int(os.environ.get("KVT_CHAOS_MAPFULL_WINDOWS", "8"))
CHUNKS = 16                      # 16 x 32 KiB objects = 512 KiB per job
L2_MIB = int(os.environ.get("KVT_CHAOS_MAPFULL_MIB", "64"))


class MapFullTest(unittest.TestCase):
    def test_map_full_keeps_committing(self):
        srv = Server(l2=True, l1_size="64M", l2_size="%dM" % L2_MIB, l2_sync="none", prefix="kvt-chaos-mapfull-")
        srv.start()
        dl = Deadlines()
        rank = None
        sched = None
        with Scenario("map_full", "L2 map full for %d s: a %d MiB L2 (map) under a steady store loop of 32 KiB "
                      "objects, then a restart" % (WINDOWS * WINDOW_S, L2_MIB)) as sc:
            try:
                rank = Rank(srv, "mapfull", NS, 0, 1, blocks=256, block_bytes=16 << 10, bpc=2)
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                s0, _ = dl.call("stats", 5000, sched.stats)
                samples = [s0]
                rank.send("loop", job0=1, prompt0=1, n=CHUNKS, timeout_ms=5000)
                t0 = time.monotonic()
                for w in range(1, WINDOWS + 1):
                    time.sleep(max(0.0, t0 + w * WINDOW_S - time.monotonic()))
                    st, e = dl.call("stats", 5000, sched.stats)
                    self.assertIsNone(e, "stats failed: %s" % e)
                    samples.append(st)
                rank.send("stop")
                res = rank.recv()
                elapsed = time.monotonic() - t0
                dl.merge(res["dl"])
                jobs = res["jobs"]
                committed = [j for j in jobs if j.get("final") == "committed"]
                refused = [j for j in jobs if j.get("final") != "committed"]
                per_window = [stat_delta(a, b, "l2_writes_committed") for a, b in zip(samples, samples[1:])]
                err_window = [stat_delta(a, b, "l2_write_errors") for a, b in zip(samples, samples[1:])]
                last = samples[-1]
                sc.load = "%.0f store jobs/s, %.1f MiB/s of 32 KiB objects (%d jobs, %.0f MiB = %.1fx the map)" % (
                    len(jobs) / elapsed, len(committed) * CHUNKS * 32 / 1024 / elapsed, len(jobs),
                    len(committed) * CHUNKS * 32 / 1024, len(committed) * CHUNKS * 32 / 1024 / L2_MIB)
                sc.numbers.update({
                    "windows_s": WINDOW_S, "l2_writes_committed_per_window": per_window,
                    "l2_write_errors_per_window": err_window, "l2_evictions": last.get("l2_evictions"),
                    "l2_map_full_retries": last.get("l2_map_full_retries"),
                    "l2_write_drops": last.get("l2_write_drops"), "stores_refused": len(refused),
                    "l2_objects_end": last.get("l2_objects")})
                self.assertEqual(refused[:3], [], "stores not committed")
                self.assertTrue(all(d > 0 for d in per_window),
                                "a 5 s window without an L2 commit: %s%s" % (per_window, tail(srv)))
                self.assertEqual(sum(err_window[1:]), 0,
                                 "L2 write errors after the first window: %s%s" % (err_window, tail(srv)))
                self.assertGreater(last.get("l2_evictions", 0), 0, "the map never filled up")
                # the newest jobs, from L1 and L2: byte-exact
                wrong = 0
                newest = [j["job"] for j in committed[-4:]]
                for i, job in enumerate(newest):
                    r = rank.do("retrieve", job=100000 + i, prompt=job, n=CHUNKS)
                    dl.merge(r["dl"])
                    self.assertEqual(r["retrieve"], "open", r)
                    wrong += r["wrong_bytes"]
                # a restart (SIGTERM flushes the queue): L2 serves the newest
                # job, and keeps committing
                sched.close()
                sched = None
                self.assertEqual(srv.stop(), 0)
                srv.start()
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                r = rank.do("wait_reconnect", count=1)
                self.assertEqual(r["error"], 0, r)
                look, e = dl.call("lookup", 5000, sched.lookup, keys_of(NS, newest[-1], CHUNKS, 32))
                self.assertIsNone(e)
                l2_hits = look.hits
                if look.hits:
                    r = rank.do("retrieve", job=200000, prompt=newest[-1], n=look.hits)
                    dl.merge(r["dl"])
                    self.assertEqual(r["retrieve"], "open", r)
                    wrong += r["wrong_bytes"]
                a, _ = dl.call("stats", 5000, sched.stats)
                rank.send("loop", job0=300000, prompt0=300000, n=CHUNKS, timeout_ms=5000)
                time.sleep(WINDOW_S)
                b, _ = dl.call("stats", 5000, sched.stats)
                rank.send("stop")
                res = rank.recv()
                dl.merge(res["dl"])
                after_restart = stat_delta(a, b, "l2_writes_committed")
                sc.numbers.update({"wrong_bytes": wrong, "newest_job_l2_hits_after_restart": l2_hits,
                                   "l2_writes_committed_5s_after_restart": after_restart,
                                   "l2_write_errors_after_restart": stat_delta(a, b, "l2_write_errors"),
                                   "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "nothing committed lost; L2 evicts its least recently used objects (a cache)"
                self.assertEqual(wrong, 0, "wrong bytes served")
                self.assertGreater(l2_hits, 0, "L2 lost the newest job across a restart")
                self.assertGreater(after_restart, 0, "no L2 commit after the restart%s" % tail(srv))
                self.assertEqual(stat_delta(a, b, "l2_write_errors"), 0)
                self.assertEqual(dl.late, [], "requests answered after their deadline")
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                if sched:
                    sched.close()
                if rank:
                    rank.close()
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
