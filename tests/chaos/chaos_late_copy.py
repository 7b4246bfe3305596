#!/usr/bin/python3
"""Chaos 9: copies past their deadline (issue 33 #3, protocol.md §9.7). The
server's host copy threads are held before every task (KVS_TEST_COPY_DELAY_MS,
a test hook of server/copy_host.c) for longer than the job deadline
(--job-deadline-ms 600), so that a job aborts while its copies are in flight.
The engine may reuse a part's blocks only once told the job ended (job_done,
the deferred reply of a part that carried complete, a terminal job_status);
this checks that none of those comes before the held copies ended, and that
nothing is written into the blocks afterwards (poisoned at the end, re-read
later):

1. a retrieve whose copies outlast the deadline;
2. a store (its part carrying complete) whose copies outlast the deadline:
   the deferred reply comes after them, nothing of it is visible;
3. a retrieve whose session closes (bye) while its copies are held: the
   job ends only after them, and the closed session's memory (still mapped
   here) is never written after the end.

The engine side is this process (the Python binding, memfd host memory):
the server is the real binary; the copies are its real copy threads."""

import os
import time
import unittest

import kvside
from chaos_lib import Deadlines, Scenario, Server, keys_of, object_bytes, tail, watchdog

NS = "chaos-late"
BPC, BB = 1, 32 << 10          # one block of 32 KiB per chunk
BLOCKS = 64
N = 4                           # chunks per job
HOLD_MS = 1500                  # each copy task waits this long first
DEADLINE_MS = 600
POISON = 0x5A
SENTINEL = 0xA5
REREAD_S = 2.0                  # after the end, how long the poison must stay


class Engine:
    """A worker session over one memfd region (blocks [0, 32) sources,
    [32, 64) destinations), with its events timed."""

    def __init__(self, srv, engine):
        self.events = []
        self.mem = kvside.HostMemory(BLOCKS * BB, name="kvt-late-" + engine)
        self.c = kvside.Client(engine, NS, role="worker", rank=0, world=1, broker_dir=srv.run, timeout_ms=8000,
                               on_event=lambda ev: self.events.append((time.monotonic(), ev)))
        self.c.register_memory([self.mem], groups=[kvside.Group(0, "attention", 16, BPC)],
                               layers=[kvside.Layer(0, 0, 0, BLOCKS, BB, BB)], timeout_ms=8000)

    def fill(self, first, n, byte):
        self.mem.view[first * BB:(first + n) * BB] = bytes([byte]) * (n * BB)

    def read(self, first, n):
        return bytes(self.mem.view[first * BB:(first + n) * BB])

    def done_at(self, job):
        return next((t for t, ev in self.events if ev.type == "job_done" and ev.job == job), None)


def keys(prompt):
    return keys_of(NS, prompt, N, 16 * BPC)


def watch_status(sched, job, until_s):
    """Polls job_status every 20 ms until the job is terminal (or until_s):
    [(t, state, reason)]."""
    out, t_end = [], time.monotonic() + until_s
    while time.monotonic() < t_end:
        info = sched.job_status([job], timeout_ms=3000)[0]
        out.append((time.monotonic(), info.state, info.reason))
        if info.state in ("committed", "aborted"):
            break
        time.sleep(0.02)
    return out


class LateCopyTest(unittest.TestCase):
    def test_late_copies(self):
        srv = Server("--job-deadline-ms", str(DEADLINE_MS), l2=True, l2_sync="full", prefix="kvt-chaos-late-")
        dog = watchdog(srv, 50, "chaos_late_copy")
        dl = Deadlines()
        engines = []
        fault = ("host copy threads held %d ms before every task, job deadline %d ms: a retrieve, a store "
                 "(complete riding on the part) and a retrieve whose session closes mid-copy" % (HOLD_MS, DEADLINE_MS))
        with Scenario("late_copy", fault) as sc:
            try:
                # the objects, committed to L2 by a server without the hook
                srv.start()
                e = Engine(srv, "eng-a")
                engines.append(e)
                data = [object_bytes(0, k, BB) for k in keys(1)]
                for i, d in enumerate(data):
                    e.mem.view[i * BB:(i + 1) * BB] = d
                st = srv.stats()
                self.assertEqual(e.c.store(1, keys(1), [list(range(N))], timeout_ms=8000), "open")
                e.c.complete(1, True, timeout_ms=8000)
                self.assertEqual(e.c.job_wait(1, timeout_ms=8000), "committed")
                t_end = time.monotonic() + 10
                while srv.stats().get("l2_writes_committed", 0) < st.get("l2_writes_committed", 0) + N:
                    self.assertLess(time.monotonic(), t_end, "L2 did not commit the objects")
                    time.sleep(0.05)
                e.c.close()
                engines.clear()
                self.assertEqual(srv.stop(), 0)
                os.environ["KVS_TEST_COPY_DELAY_MS"] = str(HOLD_MS)
                try:
                    srv.start()
                finally:
                    del os.environ["KVS_TEST_COPY_DELAY_MS"]
                e = Engine(srv, "eng-a")
                engines.append(e)
                sched = kvside.Client("eng-a", NS, role="scheduler", broker_dir=srv.run, timeout_ms=3000)
                engines.append(sched)
                n = sc.numbers

                # 1. a retrieve past its deadline
                e.fill(32, N, SENTINEL)
                t0 = time.monotonic()
                p = e.c.retrieve_async(10, keys(1), [list(range(32, 32 + N))], timeout_ms=8000)
                e.c.complete_async(10, True, timeout_ms=8000)
                seen = watch_status(sched, 10, 8)
                self.assertTrue(p.wait(8), "retrieve part never answered")
                t_end = time.monotonic() + 5
                while e.done_at(10) is None and time.monotonic() < t_end:
                    time.sleep(0.01)
                t_done = e.done_at(10)
                self.assertIsNotNone(t_done, "no job_done for the retrieve")
                e.fill(32, N, POISON)
                t_poison = time.monotonic()
                open_after_deadline = [s for t, s, r in seen if t - t0 > DEADLINE_MS / 1000 + 0.2 and s == "open"
                                       and "deadline" in r]
                terminal = [(t, s) for t, s, r in seen if s in ("committed", "aborted")]
                self.assertTrue(terminal, "job_status never terminal: %s" % seen[-3:])
                n["retrieve_end_ms"] = round((t_done - t0) * 1000)
                n["retrieve_status_terminal_ms"] = round((terminal[0][0] - t0) * 1000)
                n["retrieve_status_open_aborting_polls"] = len(open_after_deadline)
                self.assertGreaterEqual(t_done - t0, HOLD_MS / 1000 - 0.05,
                                        "job_done %.3f s after the part: before the held copies ended" % (t_done - t0))
                self.assertGreaterEqual(terminal[0][0] - t0, HOLD_MS / 1000 - 0.05,
                                        "job_status terminal before the held copies ended: %s" % seen)
                self.assertGreater(len(open_after_deadline), 0,
                                   "job_status never showed the aborting job as open: %s" % seen)
                self.assertEqual(terminal[0][1], "aborted")
                time.sleep(max(0.0, REREAD_S - (time.monotonic() - t_poison)))
                got = e.read(32, N)
                n["retrieve_bytes_written_after_end"] = len(got) - got.count(POISON)
                self.assertEqual(n["retrieve_bytes_written_after_end"], 0)

                # 2. a store past its deadline, complete riding on the part
                data2 = [object_bytes(0, k, BB) for k in keys(2)]
                for i, d in enumerate(data2):
                    e.mem.view[(8 + i) * BB:(9 + i) * BB] = d
                t0 = time.monotonic()
                p = e.c.store_complete_async(20, keys(2), [list(range(8, 8 + N))], timeout_ms=8000)
                self.assertTrue(p.wait(8), "store part never answered")
                t_reply = time.monotonic()
                n["store_end_ms"] = round((t_reply - t0) * 1000)
                self.assertGreaterEqual(t_reply - t0, HOLD_MS / 1000 - 0.05,
                                        "the store's deferred reply came before its held copies ended")
                self.assertEqual((p.code, p.state), (0, "aborted"), p.msg)
                e.fill(8, N, POISON)   # the engine reuses its sources
                look = sched.lookup(keys(2), timeout_ms=3000)
                n["store_chunks_visible"] = look.hits
                self.assertEqual(look.hits, 0, "an aborted store is visible")

                # 3. a retrieve whose session closes mid-copy
                e3 = Engine(srv, "eng-c")
                engines.append(e3)
                sched3 = kvside.Client("eng-c", NS, role="scheduler", broker_dir=srv.run, timeout_ms=3000)
                engines.append(sched3)
                e3.fill(32, N, SENTINEL)
                t0 = time.monotonic()
                e3.c.retrieve_async(30, keys(1), [list(range(32, 32 + N))], timeout_ms=8000)
                time.sleep(0.3)
                e3.c.close()           # bye: the session ends with its part's copies held
                seen = watch_status(sched3, 30, 8)
                terminal = [(t, s) for t, s, r in seen if s in ("committed", "aborted")]
                self.assertTrue(terminal, "job_status never terminal: %s" % seen[-3:])
                e3.fill(32, N, POISON)
                n["closed_session_end_ms"] = round((terminal[0][0] - t0) * 1000)
                self.assertGreaterEqual(terminal[0][0] - t0, HOLD_MS / 1000 - 0.05,
                                        "the closed session's job ended before its held copies: %s" % seen)
                time.sleep(REREAD_S)
                got = e3.read(32, N)
                n["closed_session_bytes_written_after_end"] = len(got) - got.count(POISON)
                self.assertEqual(n["closed_session_bytes_written_after_end"], 0)
                self.assertIsNone(srv.proc.poll(), "server died%s" % tail(srv))
                n.update({"hold_ms": HOLD_MS, "deadline_ms": DEADLINE_MS, "requests": dl.requests,
                          "late": len(dl.late), "wrong_bytes": 0})
                sc.load = "1 engine (memfd host memory), jobs of %d chunks x 32 KiB; a second engine whose session closes mid-copy" % N
                sc.lost = "nothing: every job ended only after its copies; no byte written into blocks after the end"
            finally:
                dog.cancel()
                for x in reversed(engines):
                    try:
                        (x.c if isinstance(x, Engine) else x).close()
                    except Exception:
                        pass
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
