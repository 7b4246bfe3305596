#!/usr/bin/python3
"""Chaos 3: swapped L2 records (issue 16 #2). With the server stopped, pairs
of objects' records in data.mdb are exchanged: two leaf nodes' overflow-page
pointers swapped in the file (within a rank, and across two ranks), and two
records re-put under each other's keys with raw LMDB writes. After a
restart, retrieving any of them must be a miss (E_MISS, nothing written) or
byte-exact — never the other object's bytes; every other object still
serves byte-exact (records bind their full key: protocol §14.2)."""

import os
import unittest

import kvside
import lmdb_raw
from chaos_lib import Deadlines, Rank, Scenario, Server, all_do, keys_of, tail

NS = "chaos-swap"
CHUNKS = 8
PROMPTS = (1, 2)


def objkey_of(records, chunk_key, rank):
    for k, _, _ in records:
        if k[:32] == chunk_key and int.from_bytes(k[52:56], "little") == rank:
            return k
    raise KeyError("no L2 record for rank %d" % rank)


class SwappedRecordsTest(unittest.TestCase):
    def test_swapped_records_never_serve_other_bytes(self):
        srv = Server(l2=True, l1_size="64M", l2_size="64M", l2_sync="full", prefix="kvt-chaos-swap-")
        l2dir = os.path.join(srv.tmp, "l2")
        srv.start()
        dl = Deadlines()
        ranks = []
        with Scenario("swapped_records", "4 pairs of L2 records swapped in data.mdb with the server stopped: "
                      "leaf overflow-page pointers (same rank; across ranks) and raw LMDB re-puts (same rank; "
                      "across ranks)", load="2 ranks, 2 jobs of 8 chunks x 32 KiB objects") as sc:
            try:
                ranks = [Rank(srv, "swap", NS, r, 2) for r in range(2)]
                for j, p in enumerate(PROMPTS):
                    for res in all_do(ranks, "store", job=1 + j, prompt=p, n=CHUNKS):
                        dl.merge(res["dl"])
                        self.assertEqual(res.get("final"), "committed", res)
                self.assertEqual(srv.stop(), 0)  # SIGTERM: the queue is flushed
                env = lmdb_raw.Env(l2dir, readonly=True)
                recs = env.records()
                env.close()
                self.assertEqual(len(recs), 2 * CHUNKS * 2)
                k1, k2 = keys_of(NS, 1, CHUNKS, 32), keys_of(NS, 2, CHUNKS, 32)
                pairs = {  # (rank, chunk key) pairs whose records are exchanged
                    "pointer, same rank": ((0, k1[0]), (0, k1[1])),
                    "pointer, across ranks": ((0, k1[3]), (1, k1[3])),
                    "re-put, same rank": ((0, k2[0]), (0, k2[5])),
                    "re-put, across ranks": ((0, k2[2]), (1, k2[2])),
                }
                for how, ((ra, ka), (rb, kb)) in pairs.items():
                    a, b = objkey_of(recs, ka, ra), objkey_of(recs, kb, rb)
                    if how.startswith("pointer"):
                        self.assertGreaterEqual(lmdb_raw.swap_overflow_pointers(l2dir, a, b), 2)
                    else:
                        lmdb_raw.swap_values(l2dir, a, b)
                # the damage is real: raw reads now find the other's record
                env = lmdb_raw.Env(l2dir, readonly=True)
                after = {k: v for k, v, _ in env.records()}
                env.close()
                before = {k: v for k, v, _ in recs}
                swapped = [k for k in before if after[k] != before[k]]
                self.assertEqual(len(swapped), 8)
                srv.start()
                for r in ranks:
                    self.assertEqual(r.do("wait_reconnect", count=1)["error"], 0)
                served = misses = unserved = wrong = wrong_parts = written = 0
                job = 100
                for p in PROMPTS:
                    for c in range(CHUNKS):
                        job += 1
                        for res in all_do(ranks, "retrieve", job=job, prompt=p, first=c, n=1):
                            dl.merge(res["dl"])
                            wrong += res["wrong_bytes"]
                            written += res["written_on_error"]
                            if res["wrong_bytes"]:
                                wrong_parts += 1
                            elif res["retrieve"] in ("open", "aborted") and res["chunks_ok"] == 1:
                                served += 1
                            elif res["retrieve"] == "aborted" and res["chunks_unwritten"] == 1:
                                unserved += 1  # the other rank's part missed first
                            elif res["retrieve"] == "E_MISS":
                                misses += 1
                            else:
                                self.fail("retrieve answered %s%s" % (res, tail(srv)))
                with kvside.Client("probe", NS, role="scheduler", broker_dir=srv.run) as c:
                    st, _ = dl.call("stats", 5000, c.stats)
                sc.numbers.update({"objects": len(recs), "records_swapped": len(swapped),
                                   "parts_served_byte_exact": served, "parts_missed": misses,
                                   "parts_not_copied_job_aborted": unserved,
                                   "wrong_bytes": wrong, "parts_served_wrong": wrong_parts, "bytes_written_on_miss": written,
                                   "l2_key_mismatches": st.get("l2_key_mismatches"),
                                   "l2_checksum_failures": st.get("l2_checksum_failures"),
                                   "requests": dl.requests, "late": len(dl.late)})
                sc.lost = "the %d swapped objects (misses, deleted); nothing else" % len(swapped)
                self.assertEqual(wrong, 0, "another object's bytes served: %d parts, %d bytes%s" % (
                    wrong_parts, wrong, tail(srv)))
                self.assertEqual(written, 0, "bytes written by a retrieve that missed")
                # only the swapped objects may miss: the rest is intact
                self.assertLessEqual(misses, len(swapped))
                self.assertGreaterEqual(served, 2 * CHUNKS * 2 - 2 * len(swapped))
                self.assertEqual(dl.late, [])
                self.assertIsNone(srv.proc.poll(), "server died")
            finally:
                for r in ranks:
                    r.close()
                srv.stop()
                srv.cleanup()


if __name__ == "__main__":
    unittest.main()
