#!/usr/bin/python3
"""The L3 tier with tensor-parallel ranks and concurrent readers (issue 17):
two ranks (world 2, one process each) store through server 1; two ranks
registered with server 2 retrieve through L3, each its own rank's bytes
(rank-specific data, so a swap would show). A chunk whose rank-1 object is
missing from L3 is not a hit on server 2 (a hit needs every rank). Two
engines on server 2 retrieving the same L3 chunks at once both get them
byte-exact, and the objects are read from L3 once (promotions shared)."""

import time
import unittest

import l3lib
from l3lib import Rank, delta, l3_server, objkey, prompt_keys, redis_key, scheduler

LAYERS, BLOCK = 2, 16 << 10


class RanksTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        l3lib.skip_unless_ready()
        cls.rc = l3lib.start_cluster()
        cls.s1 = l3_server(cls.rc.seeds, l1_size="128M", prefix="kvt-l3a-")
        cls.s2 = l3_server(cls.rc.seeds, l1_size="128M", prefix="kvt-l3b-")
        cls.s1.start()
        cls.s2.start()
        cls.ranks = []

    @classmethod
    def tearDownClass(cls):
        l3lib.teardown(cls)

    def rank(self, srv, engine, rank, world):
        r = Rank(srv, engine, LAYERS, 256, BLOCK, rank=rank, world=world)
        self.ranks.append(r)
        return r

    def test_1_two_ranks(self):
        a = [self.rank(self.s1, "tp-a", r, 2) for r in range(2)]
        b = [self.rank(self.s2, "tp-b", r, 2) for r in range(2)]
        prompts, n = [1, 2, 3, 4], 3
        st1 = self.s1.stats()
        for i, p in enumerate(prompts):
            for r in a:
                r.store_async(10 + i, prompt_keys(p, n), 0)
            for r in a:
                out = r.recv()
                self.assertTrue(out["ok"], out)
        w = l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + len(prompts) * n * 2)
        self.assertEqual(delta(w, st1, "l3_write_drops") + delta(w, st1, "l3_write_errors"), 0)
        # prompt 4: rank 1's object of chunk 1 removed from L3
        self.rc.route("DEL", redis_key(objkey(prompt_keys(4, n)[1], world=2, rank=1)))
        with l3lib.kvside.Client("sched", l3lib.NS, role="scheduler", world=2, broker_dir=self.s2.run) as sc:
            for p in prompts[:3]:
                lk = sc.lookup(prompt_keys(p, n))
                self.assertEqual((lk.hits, lk.tiers), (n, ["l3"] * n), "prompt %d" % p)
            lk = sc.lookup(prompt_keys(4, n))
            self.assertEqual(lk.hits, 1, "a chunk with rank 1's object missing from L3 hit")
        for i, p in enumerate(prompts[:3]):
            for r in b:
                r.retrieve_async(100 + i, prompt_keys(p, n), 20)
            for k, r in enumerate(b):
                out = r.recv()
                self.assertTrue(out["ok"], "rank %d: %s" % (k, out))
                self.assertEqual(out["wrong_bytes"], 0, "rank %d got other bytes: %s" % (k, out))

    def test_2_concurrent_readers_share_a_fetch(self):
        a = self.rank(self.s1, "one-a", 0, 1)
        c = self.rank(self.s2, "one-c", 0, 1)
        d = self.rank(self.s2, "one-d", 0, 1)
        n = 8
        keys = prompt_keys(50, n)
        st1 = self.s1.stats()
        self.assertTrue(a.store(1, keys, 0)["ok"])
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + n)
        with scheduler(self.s2) as sc:
            self.assertEqual(sc.lookup(keys).hits, n)
        st2 = self.s2.stats()
        c.retrieve_async(1, keys, 0)
        d.retrieve_async(1, keys, 64)
        oc, od = c.recv(), d.recv()
        self.assertTrue(oc["ok"], oc)
        self.assertTrue(od["ok"], od)
        self.assertEqual((oc["wrong_bytes"], od["wrong_bytes"]), (0, 0))
        a2 = self.s2.stats()
        print("two readers of %d objects: l3_reads +%d, l3_promotions +%d" % (
            n, delta(a2, st2, "l3_reads"), delta(a2, st2, "l3_promotions")))
        self.assertEqual(delta(a2, st2, "l3_reads"), n, "objects read from L3 more than once")

    def test_3_retrieve_without_lookup(self):
        """A retrieve of chunks only in L3 that no lookup on this server has
        seen: what the tier does (informative: protocol.md §6.8 does not say)."""
        a = self.rank(self.s1, "nl-a", 0, 1)
        e = self.rank(self.s2, "nl-e", 0, 1)
        keys = prompt_keys(60, 2)
        st1 = self.s1.stats()
        self.assertTrue(a.store(1, keys, 0)["ok"])
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + 2)
        out = e.retrieve(1, keys, 0)
        print("retrieve of L3-only chunks without a lookup first:", "OK" if out["ok"] else out.get("code"))
        if out["ok"]:
            self.assertEqual(out["wrong_bytes"], 0)
        else:
            self.assertTrue(out["untouched"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
