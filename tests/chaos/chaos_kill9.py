#!/usr/bin/python3
"""Chaos 5: kill -9 under write-behind. Two rank processes store 4-chunk
jobs (16 KiB objects) in a loop against a server with L2 (fsync at every
group commit, so the writer runs behind) and a 32 MiB L1; the server is
SIGKILLed at random points (fixed seed) and restarted, several rounds. Before
each round's loop, two jobs are stored and waited for until L2 committed
them: those must survive every later kill. After each restart every chunk a
lookup reports is retrieved by both ranks and compared with their source
bytes: 0 wrong bytes. Stores are never refused (E_NOSPACE) while the server
lives, and every request is answered or times out by its own deadline.

KVT_CHAOS_FLIP_BYTE=1 (a dry run) makes the ranks flip one retrieved byte:
the scenario must then fail."""

import os
import random
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, all_do, keys_of, tail, wait_session

NS = "chaos-kill9"
ROUNDS = int(os.environ.get("KVT_CHAOS_KILL9_ROUNDS", "6"))
SEED = 16
LOOP_CHUNKS = 4
DURABLE_CHUNKS = 8
WORLD = 2
CT = 32                          # chunk tokens (16 per block, 2 blocks per chunk)


class Kill9Test(unittest.TestCase):
    def test_kill9_under_write_behind(self):
        srv = Server(l2=True, l1_size="32M", l2_size="1G", l2_sync="full", ttl_ms=3000, prefix="kvt-chaos-kill9-")
        srv.start()
        self.srv = srv
        rng = random.Random(SEED)
        dl = Deadlines()
        ranks = []
        sched = None
        fault = "SIGKILL of the server at a random point (seed %d) of a store loop with L2 write-behind " \
                "(l2-sync full), %d rounds, restart after each" % (SEED, ROUNDS)
        with Scenario("kill9", fault) as sc:
            try:
                ranks = [Rank(srv, "k9", NS, r, WORLD, blocks=256, block_bytes=8 << 10, timeout_ms=2000) for r in range(WORLD)]
                sched = kvside.Client("sched", NS, role="scheduler", world=WORLD, broker_dir=srv.run, timeout_ms=3000)
                durable = []        # (prompt, chunks) L2 committed before a kill
                stored = 0
                refused = []
                verified_chunks = loop_chunks = wrong = written = 0
                lost_committed = []
                kill_after = []
                t_loop = 0.0
                for rnd in range(1, ROUNDS + 1):
                    # 1. two jobs that L2 commits before the kill
                    a, _ = dl.call("stats", 3000, sched.stats)
                    for j in range(2):
                        p = rnd * 100000 + 90000 + j
                        for res in all_do(ranks, "store", job=p, prompt=p, n=DURABLE_CHUNKS, timeout_ms=5000):
                            dl.merge(res["dl"])
                            self.assertEqual(res.get("final"), "committed", res)
                        durable.append((p, DURABLE_CHUNKS))
                    want = a.get("l2_writes_committed", 0) + 2 * DURABLE_CHUNKS * WORLD
                    for _ in range(400):
                        b, _ = dl.call("stats", 3000, sched.stats)
                        if b.get("l2_writes_committed", 0) >= want:
                            break
                        time.sleep(0.025)
                    self.assertGreaterEqual(b.get("l2_writes_committed", 0), want, "L2 never committed%s" % tail(srv))
                    self.assertEqual(b.get("l2_write_drops", 0) + b.get("l2_writes_shed", 0),
                                     a.get("l2_write_drops", 0) + a.get("l2_writes_shed", 0))
                    # 2. the loop, and a SIGKILL at a random point of it
                    job0 = rnd * 100000
                    for r in ranks:
                        r.send("loop", job0=job0, prompt0=job0, n=LOOP_CHUNKS, timeout_ms=2000)
                    delay = rng.uniform(0.2, 2.0)
                    kill_after.append(round(delay, 2))
                    t0 = time.monotonic()
                    time.sleep(delay)
                    srv.kill()
                    t_loop += time.monotonic() - t0
                    for r in ranks:
                        r.send("stop")
                    loops = [r.recv(60) for r in ranks]
                    jobs = set()
                    for lp in loops:
                        dl.merge(lp["dl"])
                        for j in lp["jobs"]:
                            jobs.add(j["job"])
                            if "E_NOSPACE" in (j.get("store"), j.get("complete"), j.get("final")):
                                refused.append(j)
                    stored += len(jobs)
                    # 3. restart; the ranks re-open and re-register by themselves
                    srv.start()
                    for r in ranks:
                        res = r.do("wait_reconnect", count=rnd, timeout_ms=20000)
                        self.assertEqual(res["error"], 0, res)
                    wait_session(dl, sched)
                    # 4. every chunk lookup reports: byte-exact on both ranks
                    for job in sorted(jobs):
                        look, e = dl.call("lookup", 3000, sched.lookup, keys_of(NS, job, LOOP_CHUNKS, CT))
                        self.assertIsNone(e, "lookup after restart: %s" % e)
                        if look.hits:
                            c, w, wr = self.retrieve(ranks, dl, 500000 + rnd * 10000 + job % 10000, job, look.hits)
                            verified_chunks += c
                            loop_chunks += c
                            wrong += w
                            written += wr
                    # 5. nothing L2 had committed is lost
                    for p, n in durable:
                        look, e = dl.call("lookup", 3000, sched.lookup, keys_of(NS, p, n, CT))
                        self.assertIsNone(e)
                        if look.hits != n:
                            lost_committed.append((rnd, p, look.hits))
                self.assertEqual(lost_committed, [], "jobs L2 had committed were lost")
                # the durable jobs of every round, byte-exact at the end
                for i, (p, n) in enumerate(durable):
                    c, w, wr = self.retrieve(ranks, dl, 900000 + i, p, n)
                    verified_chunks += c
                    wrong += w
                    written += wr
                st, _ = dl.call("stats", 3000, sched.stats)
                sc.load = "2 ranks storing 4-chunk jobs of 16 KiB objects: %d jobs in %.1f s of loops (%.0f jobs/s, " \
                          "%.1f MiB/s)" % (stored, t_loop, stored / t_loop, stored * LOOP_CHUNKS * WORLD * 16 / 1024 / t_loop)
                sc.numbers.update({
                    "rounds": ROUNDS, "kill_after_s": kill_after, "jobs_stored_in_loops": stored,
                    "durable_jobs": len(durable), "durable_jobs_lost": lost_committed,
                    "l2_objects_end": st.get("l2_objects"), "l2_evictions_last_run": st.get("l2_evictions"),
                    "chunks_verified_byte_exact": verified_chunks,
                    "loop_chunks_found_after_kill": loop_chunks, "wrong_bytes": wrong,
                    "bytes_written_by_failed_retrieves": written, "stores_refused_E_NOSPACE": len(refused),
                    "l2_checksum_failures_last_run": st.get("l2_checksum_failures"),
                    "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "only objects not yet committed to L2 at a kill; every L2-committed job survived, " \
                          "every chunk served byte-exact"
                self.assertEqual(wrong, 0, "wrong bytes served after a kill -9")
                self.assertGreater(loop_chunks, 0, "no chunk of the loops survived: nothing was checked")
                self.assertEqual(written, 0, "a failed retrieve wrote bytes")
                self.assertEqual(lost_committed, [], "jobs L2 had committed were lost")
                self.assertEqual(refused[:3], [], "stores refused with E_NOSPACE")
                self.assertEqual(dl.late, [], "requests answered after their deadline")
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                if sched:
                    sched.close()
                for r in ranks:
                    r.close()
                srv.stop()
                srv.cleanup()

    def retrieve(self, ranks, dl, job, prompt, n):
        """Both ranks retrieve prompt's first n chunks; (chunks exact, wrong bytes, bytes written on error)."""
        ok = wrong = written = 0
        for res in all_do(ranks, "retrieve", job=job, prompt=prompt, n=n, timeout_ms=5000):
            dl.merge(res["dl"])
            if res["retrieve"] != "open":
                self.fail("prompt %d: a chunk lookup reported is not retrievable: %s\n%s%s" % (
                    prompt, res, {k: v for k, v in self.srv.stats().items() if k.startswith("l2_")}, tail(self.srv)))
            ok += res["chunks_ok"]
            wrong += res["wrong_bytes"]
            written += res["written_on_error"]
        return ok, wrong, written


if __name__ == "__main__":
    unittest.main()
