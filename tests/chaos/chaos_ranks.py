#!/usr/bin/python3
"""Chaos 8: slow and killed ranks, all at once, beside a healthy 2-rank
engine that stores throughout (--job-deadline-ms 4000, --ttl-ms 1000):
  * a rank that stores and never sends complete: the job aborts at its
    deadline and its lease is released (the rank can unregister at once);
  * a rank SIGKILLed after its store part: its session expires by the ttl,
    the job aborts (well before the deadline);
  * a rank that registers and never stores: its peer's job aborts at the
    deadline; the idle rank stays registered and harmless;
  * a rank SIGSTOPped mid-job for 3 s: its session expires, the job aborts;
    after SIGCONT its client re-opens a session by itself and stores again.
The healthy engine's jobs all commit and retrieve byte-exact; at the end no
job is open and no block retained; every request answered by its deadline."""

import os
import signal
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, all_do, stop_together, tail

NS = "chaos-ranks"
DEADLINE_MS = 4000
TTL_MS = 1000
SLACK_MS = 1500                  # tick (50 ms) + a loaded machine


class RanksTest(unittest.TestCase):
    def test_slow_and_killed_ranks(self):
        srv = Server("--job-deadline-ms", str(DEADLINE_MS), ttl_ms=TTL_MS, heartbeat_ms=100, l1_size="64M",
                     prefix="kvt-chaos-ranks-")
        srv.start()
        dl = Deadlines()
        procs = []
        scheds = []

        def rank(engine, r, world=2):
            p = Rank(srv, engine, NS, r, world, blocks=64, block_bytes=16 << 10, bpc=2, timeout_ms=8000)
            procs.append(p)
            return p

        def sched(engine):
            c = kvside.Client(engine, NS, role="scheduler", world=2, broker_dir=srv.run, timeout_ms=8000)
            scheds.append(c)
            return c

        with Scenario("ranks", "ranks that never complete, are SIGKILLed after their store part, register and "
                      "never store, or are SIGSTOPped 3 s mid-job (job deadline %d ms, ttl %d ms)" % (
                          DEADLINE_MS, TTL_MS)) as sc:
            try:
                healthy = [rank("healthy", r) for r in range(2)]
                stall = [rank("stall", r) for r in range(2)]
                killed = [rank("killed", r) for r in range(2)]
                silent = [rank("silent", r) for r in range(2)]
                stopped = [rank("stopped", r) for r in range(2)]
                sch = {e: sched(e) for e in ("stall", "killed", "silent", "stopped")}
                st0, _ = dl.call("stats", 5000, sch["stall"].stats)
                sync = os.path.join(srv.tmp, "healthy-sync")
                os.mkdir(sync)
                for r in healthy:
                    r.send("loop", job0=1, prompt0=1, n=4, timeout_ms=8000, sync_dir=sync)
                t0 = time.monotonic()
                # the faulty jobs start together
                stall[0].send("store", job=1, prompt=1, n=4, timeout_ms=8000)
                stall[1].send("store", job=1, prompt=1, n=4, complete=False)
                killed[0].send("store", job=1, prompt=1, n=4, timeout_ms=8000)
                killed[1].send("store", job=1, prompt=1, n=4, complete=False)
                silent[0].send("store", job=1, prompt=1, n=4, timeout_ms=8000)
                stopped[0].send("store", job=1, prompt=1, n=4, timeout_ms=8000)
                stopped[1].send("store", job=1, prompt=1, n=4, complete=False)
                self.assertEqual(killed[1].recv()["store"], "open")
                killed[1].kill()
                t_kill = time.monotonic()
                self.assertEqual(stopped[1].recv()["store"], "open")
                os.kill(stopped[1].proc.pid, signal.SIGSTOP)
                t_stop = time.monotonic()
                self.assertEqual(stall[1].recv()["store"], "open")
                res = {}
                for name, p in (("killed", killed[0]), ("stopped", stopped[0]), ("stall", stall[0]),
                                ("silent", silent[0])):
                    res[name] = p.recv(30)
                    dl.merge(res[name]["dl"])
                    res[name]["t"] = time.monotonic()
                    self.assertEqual(res[name].get("final"), "aborted", "%s: %s" % (name, res[name]))
                reasons = {}
                for name in res:
                    info, e = dl.call("job_status", 5000, sch[name].job_status, [1])
                    self.assertIsNone(e)
                    reasons[name] = info[0].reason
                # ends: the killed and stopped ranks' jobs by the ttl, the
                # others by the deadline, each within its bound
                ms = {k: round((v["t"] - t0) * 1000) for k, v in res.items()}
                self.assertLess(res["killed"]["t"] - t_kill, (TTL_MS + SLACK_MS) / 1000, (ms, reasons))
                self.assertIn("session ended", reasons["killed"])
                self.assertLess(res["stopped"]["t"] - t_stop, (TTL_MS + SLACK_MS) / 1000, (ms, reasons))
                self.assertIn("session ended", reasons["stopped"])
                for name in ("stall", "silent"):
                    self.assertIn("deadline", reasons[name])
                    self.assertLess(ms[name], DEADLINE_MS + SLACK_MS, (ms, reasons))
                    self.assertGreater(ms[name], DEADLINE_MS - 500, (ms, reasons))
                # the stalled rank's lease is released: it unregisters at once
                t = time.monotonic()
                u = stall[1].do("unregister", timeout_ms=3000)
                unreg_ms = round((time.monotonic() - t) * 1000)
                dl.merge(u["dl"])
                self.assertEqual(u["unregister"], "ok", u)
                # the stopped rank comes back: a new session, registered again, stores
                os.kill(stopped[1].proc.pid, signal.SIGCONT)
                rc = stopped[1].do("wait_reconnect", count=1, timeout_ms=10000)
                self.assertEqual(rc["error"], 0, rc)
                back = all_do(stopped, "store", job=2, prompt=2, n=4, timeout_ms=8000)
                for b in back:
                    dl.merge(b["dl"])
                    self.assertEqual(b.get("final"), "committed", b)
                # the healthy engine went on throughout
                loops = stop_together(healthy, sync)
                elapsed = time.monotonic() - t0
                hjobs = [j for lp in loops for j in lp["jobs"]]
                for lp in loops:
                    dl.merge(lp["dl"])
                not_committed = [j for j in hjobs if j.get("final") != "committed"]
                n_jobs = min(len(lp["jobs"]) for lp in loops)
                wrong = 0
                for i, job in enumerate(range(max(1, n_jobs - 3), n_jobs + 1)):
                    for r in all_do(healthy, "retrieve", job=900000 + i, prompt=job, n=4):
                        dl.merge(r["dl"])
                        self.assertEqual(r["retrieve"], "open", r)
                        wrong += r["wrong_bytes"]
                st, _ = dl.call("stats", 5000, sch["stall"].stats)
                sc.load = "a healthy 2-rank engine storing %d jobs of 4 x 32 KiB in %.1f s beside 4 faulty engines" % (
                    n_jobs, elapsed)
                sc.numbers.update({
                    "abort_ms_after_start": ms, "abort_reasons": reasons,
                    "killed_abort_ms_after_kill": round((res["killed"]["t"] - t_kill) * 1000),
                    "stopped_abort_ms_after_sigstop": round((res["stopped"]["t"] - t_stop) * 1000),
                    "stalled_rank_unregister_ms": unreg_ms, "healthy_jobs": n_jobs,
                    "healthy_jobs_not_committed": len(not_committed), "wrong_bytes": wrong,
                    "sessions_reaped": st.get("sessions_reaped", 0) - st0.get("sessions_reaped", 0),
                    "jobs_open_end": st.get("jobs_open"), "retained_blocks_end": st.get("retained_blocks"),
                    "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "the faulty engines' open jobs (aborted, by ttl or deadline); nothing of the healthy " \
                          "engine"
                self.assertEqual(not_committed[:3], [], "the healthy engine's jobs were affected")
                self.assertGreater(n_jobs, 0)
                self.assertEqual(wrong, 0)
                self.assertEqual(st.get("jobs_open"), 0, "jobs still open%s" % tail(srv))
                self.assertEqual(st.get("retained_blocks"), 0, "blocks still retained%s" % tail(srv))
                self.assertGreaterEqual(st.get("sessions_reaped", 0) - st0.get("sessions_reaped", 0), 2)
                self.assertEqual(dl.late, [], "requests answered after their deadline")
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                for p in procs:
                    try:
                        os.kill(p.proc.pid, signal.SIGCONT)
                    except OSError:
                        pass
                    p.close()
                for c in scheds:
                    c.close()
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
