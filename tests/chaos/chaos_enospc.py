#!/usr/bin/python3
"""Chaos 2: a full disk under L2, then space freed (issue 16 #7). L2 (64 MiB)
lives on a 96 MiB tmpfs mounted by the test (root only: skipped otherwise),
which a filler file has filled (but for 512 KiB) before the server starts.
Under a steady store loop the file system refuses L2 space (l2_disk_full):
writing fails or stays within the blocks L2 holds, and the server must keep
serving without crashing or flooding the log; then the filler is deleted and
L2 writing resumes (l2_writes_committed grows in every window again). 0
wrong bytes, every request answered by its deadline (architecture.md §6, disk space).
"""

import errno
import os
import subprocess
import time
import unittest

import kvside
from chaos_lib import Deadlines, Rank, Scenario, Server, keys_of, sleep_alive, stat_delta, tail

NS = "chaos-enospc"
TMPFS_MIB = 96
L2_MIB = 64
ROOM_KIB = 512                   # what the filler leaves free
CHUNKS = 16
WINDOW_S = 3


def fill(path):
    """Writes path until the file system refuses; returns the bytes written."""
    n = 0
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                break
        while True:  # the last partial blocks
            try:
                n += f.write(b"\0" * 4096)
            except OSError:
                break
    return n


class EnospcTest(unittest.TestCase):
    def test_disk_full_then_freed(self):
        if os.geteuid() != 0:
            self.skipTest("needs root to mount a small tmpfs for the L2")
        srv = Server(l2=True, l1_size="64M", l2_size="%dM" % L2_MIB, l2_sync="none", prefix="kvt-chaos-enospc-")
        mnt = os.path.join(srv.tmp, "small")
        os.mkdir(mnt)
        dl = Deadlines()
        rank = sched = None
        mounted = False
        fault = "ENOSPC: L2 (%d MiB) on a %d MiB tmpfs that a filler file holds full (%d KiB free), under " \
                "stores for %d s; then the filler deleted" % (L2_MIB, TMPFS_MIB, ROOM_KIB, 2 * WINDOW_S)
        with Scenario("enospc", fault) as sc:
            try:
                r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dm,mode=0700" % TMPFS_MIB, "tmpfs", mnt],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    self.skipTest("cannot mount a tmpfs here: %s" % r.stderr.strip())
                mounted = True
                srv.extra += ["--l2-path", os.path.join(mnt, "l2")]
                # the disk is full before the server starts (but for a little
                # room: LMDB's first pages)
                filler = os.path.join(mnt, "filler")
                filled = fill(filler)
                os.truncate(filler, filled - (ROOM_KIB << 10))
                srv.start()
                rank = Rank(srv, "enospc", NS, 0, 1, blocks=256, block_bytes=16 << 10, bpc=2)
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                log0 = len(srv.log(1 << 24).splitlines())
                s0, _ = dl.call("stats", 5000, sched.stats)
                rank.send("loop", job0=1, prompt0=1, n=CHUNKS, timeout_ms=5000)
                # full: windows while the disk has no room
                full = [s0]
                for _ in range(2):
                    sleep_alive(srv, WINDOW_S)
                    full.append(dl.call("stats", 5000, sched.stats)[0])
                log_full = len(srv.log(1 << 24).splitlines()) - log0
                os.unlink(filler)
                freed = [full[-1]]
                for _ in range(3):
                    sleep_alive(srv, WINDOW_S)
                    freed.append(dl.call("stats", 5000, sched.stats)[0])
                rank.send("stop")
                res = rank.recv()
                dl.merge(res["dl"])
                jobs = res["jobs"]
                committed = [j for j in jobs if j.get("final") == "committed"]
                sleep_alive(srv, 0)
                # the newest jobs retrieve byte-exact
                wrong = 0
                for i, j in enumerate(committed[-3:]):
                    r = rank.do("retrieve", job=900000 + i, prompt=j["job"], n=CHUNKS)
                    dl.merge(r["dl"])
                    self.assertEqual(r["retrieve"], "open", r)
                    wrong += r["wrong_bytes"]
                # and from L2 after a restart
                sched.close()
                sched = None
                self.assertEqual(srv.stop(), 0)
                srv.start()
                self.assertEqual(rank.do("wait_reconnect", count=1)["error"], 0)
                sched = kvside.Client("sched", NS, role="scheduler", broker_dir=srv.run, timeout_ms=5000)
                newest = committed[-1]["job"]
                look, _ = dl.call("lookup", 5000, sched.lookup, keys_of(NS, newest, CHUNKS, 32))
                if look and look.hits:
                    r = rank.do("retrieve", job=900100, prompt=newest, n=look.hits)
                    dl.merge(r["dl"])
                    self.assertEqual(r["retrieve"], "open", r)
                    wrong += r["wrong_bytes"]
                w_full = [stat_delta(a, b, "l2_writes_committed") for a, b in zip(full, full[1:])]
                w_freed = [stat_delta(a, b, "l2_writes_committed") for a, b in zip(freed, freed[1:])]
                sc.load = "%d store jobs of 512 KiB (32 KiB objects), %.1f MiB/s" % (
                    len(jobs), len(committed) * CHUNKS * 32 / 1024 / (WINDOW_S * 5 + 1))
                sc.numbers.update({
                    "filler_mib": round((filled - (ROOM_KIB << 10)) / 1048576, 1), "window_s": WINDOW_S,
                    "l2_disk_full": full[-1].get("l2_disk_full"),
                    "l2_capacity_mib_full": full[-1].get("l2_capacity", 0) >> 20,
                    "l2_capacity_mib_freed": freed[-1].get("l2_capacity", 0) >> 20,
                    "l2_writes_committed_per_window_full": w_full,
                    "l2_writes_committed_per_window_freed": w_freed,
                    "l2_write_errors_full": stat_delta(s0, full[-1], "l2_write_errors"),
                    "l2_write_errors_freed": stat_delta(freed[0], freed[-1], "l2_write_errors"),
                    "server_log_lines_while_full": log_full, "stores_not_committed": len(jobs) - len(committed),
                    "newest_job_l2_hits_after_restart": look.hits if look else None,
                    "wrong_bytes": wrong, "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "objects L2 evicted or could not write while the disk was full (a cache); " \
                          "no store refused, nothing served wrong"
                self.assertGreater(full[-1].get("l2_disk_full", 0), 0, "the disk never refused L2%s" % tail(srv))
                self.assertTrue(all(w > 0 for w in w_freed),
                                "L2 writing did not resume after the space was freed: %s%s" % (w_freed, tail(srv)))
                self.assertLess(log_full, 100, "log flood while the disk was full%s" % tail(srv))
                self.assertEqual(len(jobs), len(committed), "stores refused")
                self.assertEqual(wrong, 0)
                self.assertEqual(dl.late, [])
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                if sched:
                    sched.close()
                if rank:
                    rank.close()
                srv.stop()
                if mounted:
                    subprocess.run(["umount", "-l", mnt])
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
