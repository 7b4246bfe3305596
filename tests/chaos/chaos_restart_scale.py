#!/usr/bin/python3
"""Chaos 10: restart completeness at scale (issue 33 #4). One rank process
stores KVT_CHAOS_RESTART_OBJECTS objects of 4 KiB (default 102,400: 400 MiB
of L2; ≥ 1,000,000 on a machine with the disk for it) in jobs of 256
chunks, and waits until L2's write-behind committed every one. Then it
stores new jobs in a loop while the server is SIGKILLed, and the server is
started again on the same L2. Measured and checked:

- the fraction of the objects committed before the kill that a lookup
  reports as hits afterwards (goal ≥ 99 %), and every one of them retrieved
  byte-exact (0 wrong bytes);
- the time from the kill (KVT_CHAOS_RESTART_COLD=1, as root: from the page
  cache dropped after it) to the server answering, to the first hit and to
  the last lookup (every prompt asked), and the start's structural check of
  data.mdb (l2_verify_us over l2_verify_bytes);
- the same rank process (no engine restart) re-registered by itself: the
  time from the server answering to its reconnect.

The figures go to the chaos results (docs/reliability.md)."""

import os
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, keys_of, tail, watchdog

NS = "chaos-restart"
OBJECTS = int(os.environ.get("KVT_CHAOS_RESTART_OBJECTS", "102400"))
PER_JOB = 256
BB = 4096
CT = 16                        # chunk tokens: one block of 16 tokens per chunk
GOAL = 0.99


class RestartScaleTest(unittest.TestCase):
    def test_restart_completeness(self):
        prompts = (OBJECTS + PER_JOB - 1) // PER_JOB
        # a 4 KiB object and its record header take two LMDB pages (8 KiB):
        # room for them below the eviction watermark, and for the loop's
        l2_mib = OBJECTS * 8 // 1024 * 3 // 2 + 128
        srv = Server(l2=True, l1_size="256M", l2_size="%dM" % l2_mib, l2_sync="none", ttl_ms=3000,
                     prefix="kvt-chaos-restart-")
        dog = watchdog(srv, int(os.environ.get("KVT_CHAOS_WATCHDOG_S", "280")), "chaos_restart_scale")
        dl = Deadlines()
        rank = sched = None
        fault = "SIGKILL of the server under a store loop after %d objects of 4 KiB were committed to L2, " \
                "then a restart on the same L2" % (prompts * PER_JOB)
        with Scenario("restart_scale", fault) as sc:
            try:
                srv.start()
                rank = Rank(srv, "restart", NS, 0, 1, blocks=2 * PER_JOB, block_bytes=BB, bpc=1, timeout_ms=8000)
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                base = srv.stats().get("l2_writes_committed", 0)
                t0 = time.monotonic()
                def caught_up(want, timeout):
                    t_end = time.monotonic() + timeout
                    while True:
                        st = srv.stats()
                        if st.get("l2_writes_committed", 0) >= want:
                            return st
                        self.assertLess(time.monotonic(), t_end, "write-behind did not catch up: %s of %d" % (
                            st.get("l2_writes_committed"), want))
                        time.sleep(0.05)
                for p in range(prompts):
                    r = rank.do("store", job=1 + p, prompt=p, n=PER_JOB, timeout_ms=20000)
                    dl.merge(r["dl"])
                    self.assertEqual(r.get("final"), "committed", r)
                    if p % 16 == 15:  # paced: the write-behind queue (L1 / 4) never drops
                        caught_up(base + (p - 15) * PER_JOB, 60)
                t_stored = time.monotonic() - t0
                st = caught_up(base + prompts * PER_JOB, 120)
                self.assertEqual(st.get("l2_write_drops", 0), 0, "write-behind dropped objects")
                t_caught_up = time.monotonic() - t0
                # kill -9 under store load (new prompts, not counted)
                rank.send("loop", job0=10 ** 6, prompt0=10 ** 6, n=16, timeout_ms=2000)
                time.sleep(1.0)
                srv.kill()
                t_kill = time.monotonic()
                cold = os.environ.get("KVT_CHAOS_RESTART_COLD") == "1"
                if cold:  # the restart of a rebooted host: data.mdb not in the page cache (root)
                    os.sync()
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3\n")
                    t_kill = time.monotonic()
                srv.start()
                t_up = time.monotonic()
                rank.send("stop")
                dl.merge(rank.recv(60)["dl"])
                rc = rank.do("wait_reconnect", count=1, timeout_ms=20000)
                t_rec = time.monotonic()
                self.assertEqual(rc["error"], 0, rc)
                sched.close()
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                # lookups of every prompt committed before the kill
                hits, t_first, missing = 0, None, []
                for p in range(prompts):
                    look, e = dl.call("lookup", 5000, sched.lookup, keys_of(NS, p, PER_JOB, CT))
                    self.assertIsNone(e, "lookup: %s%s" % (e, tail(srv)))
                    if look.hits and t_first is None:
                        t_first = time.monotonic()
                    hits += look.hits
                    if look.hits < PER_JOB:
                        missing.append((p, look.hits))
                t_all = time.monotonic()
                # every hit retrieved and compared
                wrong = verified = 0
                job = 2 * 10 ** 6
                for p in range(prompts):
                    n = next((h for q, h in missing if q == p), PER_JOB)
                    if not n:
                        continue
                    job += 1
                    res = rank.do("retrieve", job=job, prompt=p, n=n, timeout_ms=20000)
                    dl.merge(res["dl"])
                    self.assertEqual(res["retrieve"], "open", res)
                    wrong += res["wrong_bytes"]
                    verified += res["chunks_ok"]
                a = srv.stats()
                frac = hits / float(prompts * PER_JOB)
                verify_mib = a.get("l2_verify_bytes", 0) / float(1 << 20)
                sc.numbers.update({
                    "objects_committed_before_kill": prompts * PER_JOB, "objects_hit_after": hits,
                    "fraction_hit": round(frac, 5), "chunks_verified_byte_exact": verified, "wrong_bytes": wrong,
                    "prompts_short": len(missing), "store_s": round(t_stored, 1),
                    "write_behind_caught_up_s": round(t_caught_up, 1),
                    "kill_to_answering_ms": round((t_up - t_kill) * 1000),
                    "answering_to_first_hit_ms": round(((t_first or t_all) - t_up) * 1000),
                    "answering_to_all_looked_up_ms": round((t_all - t_up) * 1000),
                    "rank_reconnected_after_answering_ms": round((t_rec - t_up) * 1000),
                    "l2_verify_ms": round(a.get("l2_verify_us", 0) / 1000.0, 1),
                    "l2_verify_mib_in_use": round(verify_mib, 1),
                    "l2_verify_ms_per_gib": round(a.get("l2_verify_us", 0) / 1000.0 / (verify_mib / 1024), 1)
                    if verify_mib else None,
                    "l2_corrupt_recoveries": a.get("l2_corrupt_recoveries", 0), "page_cache": "dropped" if cold else "warm",
                    "requests": dl.requests, "late": len(dl.late)})
                sc.load = "1 rank storing %d jobs of %d chunks x 4 KiB (%d MiB), L2 %d MiB (l2-sync none: a kill -9 loses nothing committed), a " \
                          "store loop at the kill" % (prompts, PER_JOB, prompts * PER_JOB * BB >> 20, l2_mib)
                sc.lost = "%.3f %% of the objects committed before the kill; no wrong byte" % (100 * (1 - frac))
                self.assertEqual(wrong, 0, "wrong bytes served after the restart")
                self.assertEqual(a.get("l2_corrupt_recoveries", 0), 0, "the L2 was set aside")
                self.assertGreaterEqual(frac, GOAL, "only %.4f of the committed objects hit after the restart; "
                                        "short prompts %s" % (frac, missing[:10]))
                self.assertEqual(dl.late, [])
            finally:
                dog.cancel()
                if sched:
                    sched.close()
                if rank:
                    rank.close()
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
