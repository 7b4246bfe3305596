#!/usr/bin/python3
"""The L3 tier shares a cache between servers (issue 17): two kvside servers
with their own broker directories and L2 paths on one 3-master + 3-replica
Redis Cluster. Rank A (its own process) stores through server 1; rank B (its
own process), registered with server 2, looks the chunks up (tier "l3") and
retrieves them byte-exact. The records in Redis are checked against the
format of storage/kvs_record.h (header, key binding, checksum, parts).
Also: l3-write none writes nothing; a server without l3-redis sees nothing
of L3 (stats say l3_enabled 0); a reader with another l3-part-bytes reads
records split by a writer (the header's flags say the part size).

Run by meson (suite l3); KVT_L3_BREAK=nol3 runs it against servers without
L3 to show the assertions fail."""

import time
import unittest

import l3lib
from l3lib import BPC, Rank, delta, l3_server, prompt_keys, scheduler

LAYERS, BLOCK = 2, 16 << 10
OBJ = LAYERS * BPC * BLOCK         # 128 KiB per object
PART = 64 << 10                    # split: 3 parts per record


class ShareTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        l3lib.skip_unless_ready()
        cls.rc = l3lib.start_cluster()
        cls.s1 = l3_server(cls.rc.seeds, part_bytes=PART, prefix="kvt-l3a-")
        cls.s2 = l3_server(cls.rc.seeds, part_bytes=PART, prefix="kvt-l3b-")
        cls.s1.start()
        cls.s2.start()
        cls.a = Rank(cls.s1, "eng-a", LAYERS, 512, BLOCK)
        cls.b = Rank(cls.s2, "eng-b", LAYERS, 512, BLOCK)
        cls.job = 100

    @classmethod
    def tearDownClass(cls):
        l3lib.teardown(cls, ranks=("a", "b"))

    def next_job(self):
        ShareTest.job += 1
        return ShareTest.job

    def store_a(self, prompts, n_chunks):
        for p in prompts:
            r = self.a.store(self.next_job(), prompt_keys(p, n_chunks), 0)
            self.assertTrue(r["ok"], "store through server 1: %s" % r)

    def msg(self, *srvs):
        return "\n".join("server log:\n" + s.log_tail(15) for s in srvs)

    def test_1_store_on_one_serve_on_other(self):
        st1 = self.s1.stats()
        st2 = self.s2.stats()
        self.assertEqual(st1.get("l3_enabled"), 1, "server 1 has no L3 tier: %s" % l3lib.l3_stats(st1))
        prompts, n = list(range(1, 9)), 3
        self.store_a(prompts, n)
        w = l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + len(prompts) * n)
        self.assertGreaterEqual(delta(w, st1, "l3_writes"), len(prompts) * n, l3lib.l3_stats(w))
        self.assertEqual(delta(w, st1, "l3_write_errors") + delta(w, st1, "l3_write_drops"), 0, l3lib.l3_stats(w))
        self.assertGreaterEqual(delta(w, st1, "l3_write_bytes"), len(prompts) * n * OBJ)
        with scheduler(self.s2) as sc:
            for p in prompts:
                lk = sc.lookup(prompt_keys(p, n))
                self.assertEqual((lk.hits, lk.tiers), (n, ["l3"] * n), "prompt %d on server 2" % p)
            # a longer prompt: only the stored prefix hits
            lk = sc.lookup(prompt_keys(prompts[0], n + 2))
            self.assertEqual((lk.hits, lk.tiers), (n, ["l3"] * n))
        for p in prompts:
            r = self.b.retrieve(self.next_job(), prompt_keys(p, n), 100)
            self.assertTrue(r["ok"], "retrieve on server 2: %s\n%s" % (r, self.msg(self.s2)))
            self.assertEqual(r["wrong_bytes"], 0, "wrong bytes from L3: %s" % r)
        after = self.s2.stats()
        self.assertGreaterEqual(delta(after, st2, "hits_l3"), len(prompts) * n)
        self.assertGreaterEqual(delta(after, st2, "l3_reads"), len(prompts) * n, l3lib.l3_stats(after))
        self.assertGreaterEqual(delta(after, st2, "l3_read_bytes"), len(prompts) * n * OBJ)
        self.assertGreaterEqual(delta(after, st2, "l3_promotions"), len(prompts) * n)
        self.assertGreater(delta(after, st2, "l3_probes"), 0)
        self.assertEqual(delta(after, st2, "l3_corrupt"), 0)
        self.assertEqual(delta(after, st2, "l3_read_errors"), 0)
        # promoted: L1 of server 2 now
        with scheduler(self.s2) as sc:
            lk = sc.lookup(prompt_keys(prompts[0], n))
            self.assertEqual(lk.tiers, ["l1"] * n)

    def test_2_records_in_redis(self):
        """The records written for a prompt: parts, header, key, checksum, data."""
        st1 = self.s1.stats()
        self.store_a([40], 2)
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + 2)
        geom = l3lib.geom_fingerprint(LAYERS, BLOCK)
        for ck in prompt_keys(40, 2):
            ok = l3lib.objkey(ck)
            parts = []
            for i in range(8):
                v = self.rc.route("GET", l3lib.redis_key(ok, part=i))
                if v is None:
                    break
                parts.append(v)
            self.assertTrue(parts, "no record under %r" % l3lib.redis_key(ok)[:16])
            rec = b"".join(parts)
            h = l3lib.Header(rec)
            self.assertEqual((h.magic, h.version), (b"KVL2", 2))
            self.assertEqual(h.key, ok, "the header's key is the object key")
            self.assertEqual(h.geom, geom, "geometry fingerprint (protocol.md 14.2)")
            self.assertEqual(h.len, OBJ)
            self.assertEqual(h.flags, PART.bit_length() - 1, "flags = log2(part bytes) of a split record")
            self.assertEqual([len(x) for x in parts], [len(x) for x in l3lib.split_record(rec, PART)])
            data = rec[l3lib.HDR:]
            self.assertEqual(data, l3lib.object_data(ck, LAYERS, BLOCK), "the record's data is the object")
            self.assertEqual(h.checksum, h.sum(data, ok), "checksum: XXH3-64 seeded with the header's")

    def test_3_l1_prefix_then_l3(self):
        """Chunks 0-1 in server 2's L1 (stored by B), 0-3 in L3 (stored by A):
        tiers l1, l1, l3, l3, and the whole prompt retrieved byte-exact."""
        st1 = self.s1.stats()
        keys = prompt_keys(50, 4)
        r = self.b.store(self.next_job(), keys[:2], 0)
        self.assertTrue(r["ok"], r)
        r = self.a.store(self.next_job(), keys, 0)
        self.assertTrue(r["ok"], r)
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + 4)
        with scheduler(self.s2) as sc:
            lk = sc.lookup(keys)
            self.assertEqual((lk.hits, lk.tiers), (4, ["l1", "l1", "l3", "l3"]))
        r = self.b.retrieve(self.next_job(), keys, 200)
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["wrong_bytes"], 0)

    def test_4_write_none(self):
        """l3-write none: stores stay out of Redis, server 2 misses them."""
        s3 = l3_server(self.rc.seeds, write="none", prefix="kvt-l3c-")
        s3.start()
        c = None
        try:
            c = Rank(s3, "eng-c", LAYERS, 64, BLOCK)
            before = self.rc.count_prefix()
            r = c.store(1, prompt_keys(60, 3), 0)
            self.assertTrue(r["ok"], r)
            time.sleep(0.5)
            st = s3.stats()
            self.assertEqual(st.get("l3_enabled"), 1)
            self.assertEqual(st.get("l3_writes"), 0)
            self.assertEqual(self.rc.count_prefix(), before)
            with scheduler(self.s2) as sc:
                self.assertEqual(sc.lookup(prompt_keys(60, 3)).hits, 0)
        finally:
            if c:
                c.close()
            s3.stop()
            s3.cleanup()

    def test_4b_write_second_hit(self):
        """l3-write second-hit: a stored chunk is not written behind until its
        second use (here a lookup hit); then server 2 finds it in L3."""
        s6 = l3_server(self.rc.seeds, write="second-hit", prefix="kvt-l3f-")
        s6.start()
        f = None
        try:
            f = Rank(s6, "eng-f", LAYERS, 64, BLOCK)
            keys = prompt_keys(65, 2)
            r = f.store(1, keys, 0)
            self.assertTrue(r["ok"], r)
            time.sleep(0.5)
            st = s6.stats()
            self.assertEqual(st.get("l3_writes"), 0, "written at its first use")
            with scheduler(self.s2) as sc:
                self.assertEqual(sc.lookup(keys).hits, 0)
            with scheduler(s6) as sc:
                self.assertEqual(sc.lookup(keys).hits, 2)   # the second use
            w = l3lib.wait_written(s6, 2)
            self.assertGreaterEqual(w.get("l3_writes", 0), 2, l3lib.l3_stats(w))
            with scheduler(self.s2) as sc:
                lk = sc.lookup(keys)
                self.assertEqual((lk.hits, lk.tiers), (2, ["l3", "l3"]))
            r = self.b.retrieve(self.next_job(), keys, 300)
            self.assertTrue(r["ok"], r)
            self.assertEqual(r["wrong_bytes"], 0)
        finally:
            if f:
                f.close()
            s6.stop()
            s6.cleanup()

    def test_4c_colliding_objects_in_one_probe(self):
        """A prompt two of whose objects share a slot of the server's table of
        objects known to be in L3 (storage/kvs_l3.c: XXH3-64 of the object key,
        low KNOWN_BITS bits, direct-mapped; the two collide in the low 20 bits,
        so in any such table of up to 2^20 slots): the lookup must still answer
        every chunk the probe found, every time."""
        def slot(ck):
            return l3lib.xxh3(l3lib.objkey(ck)) & 0xFFFFF
        found = None
        for p in range(10000, 60000):
            seen = {}
            for j, ck in enumerate(prompt_keys(p, 64)):
                if slot(ck) in seen:
                    found = (p, seen[slot(ck)], j)
                    break
                seen[slot(ck)] = j
            if found:
                break
        p, i, j = found
        n = j + 1
        st1 = self.s1.stats()
        keys = prompt_keys(p, n)
        r = self.a.store(self.next_job(), keys, 0)
        self.assertTrue(r["ok"], r)
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + n)
        with scheduler(self.s2) as sc:
            got = [sc.lookup(keys).hits for _ in range(3)]
        self.assertEqual(got, [n] * 3, "prompt %d (chunks %d and %d share a slot): lookups answered %s of %d" % (
            p, i, j, got, n))

    def test_5_server_without_l3(self):
        """No l3-redis: the tier is off; chunks only in L3 are misses."""
        self.store_a([70], 2)
        s4 = l3lib.Server(l2=True, prefix="kvt-l3d-")
        s4.start()
        d = None
        try:
            d = Rank(s4, "eng-d", LAYERS, 64, BLOCK)
            st = s4.stats()
            self.assertEqual(st.get("l3_enabled", 0), 0)
            with l3lib.scheduler(s4) as sc:
                self.assertEqual(sc.lookup(prompt_keys(70, 2)).hits, 0)
            r = d.retrieve(1, prompt_keys(70, 2), 0)
            self.assertFalse(r["ok"])
            self.assertEqual(r["code"], "E_MISS")
        finally:
            if d:
                d.close()
            s4.stop()
            s4.cleanup()

    def test_6_reader_with_other_part_size(self):
        """Records split at 64 KiB by server 1, read by a server whose own
        l3-part-bytes is the default (8 MiB): the header's flags rule."""
        st1 = self.s1.stats()
        self.store_a([80], 2)
        l3lib.wait_written(self.s1, st1.get("l3_writes", 0) + 2)
        s5 = l3_server(self.rc.seeds, prefix="kvt-l3e-")
        s5.start()
        e = None
        try:
            e = Rank(s5, "eng-e", LAYERS, 64, BLOCK)
            with scheduler(s5) as sc:
                lk = sc.lookup(prompt_keys(80, 2))
                self.assertEqual((lk.hits, lk.tiers), (2, ["l3", "l3"]))
            r = e.retrieve(1, prompt_keys(80, 2), 0)
            self.assertTrue(r["ok"], "%s\n%s" % (r, s5.log_tail(10)))
            self.assertEqual(r["wrong_bytes"], 0)
        finally:
            if e:
                e.close()
            s5.stop()
            s5.cleanup()


class PasswordTest(unittest.TestCase):
    """A cluster with requirepass: servers with l3-password share through it;
    a server with a wrong password keeps serving L1 (stores commit, lookups
    answer) and says it has no L3 connection."""

    def test_password(self):
        l3lib.skip_unless_ready()
        rc = l3lib.Cluster(masters=3, replicas=0, password="s3cret-l3")
        rc.start()
        srvs, ranks = [], []
        try:
            s1 = l3_server(rc.seeds, "--l3-password", "s3cret-l3", prefix="kvt-l3pa-")
            s2 = l3_server(rc.seeds, "--l3-password", "s3cret-l3", prefix="kvt-l3pb-")
            bad = l3_server(rc.seeds, "--l3-password", "wrong", prefix="kvt-l3pc-")
            for s in (s1, s2, bad):
                srvs.append(s)
                s.start()
            a, b, c = Rank(s1, "pa", LAYERS, 64, BLOCK), Rank(s2, "pb", LAYERS, 64, BLOCK), Rank(bad, "pc", LAYERS, 64, BLOCK)
            ranks += [a, b, c]
            keys = prompt_keys(90, 2)
            self.assertTrue(a.store(1, keys, 0)["ok"])
            w = l3lib.wait_written(s1, 2)
            self.assertEqual(w.get("l3_writes"), 2, l3lib.l3_stats(w))
            with scheduler(s2) as sc:
                self.assertEqual(sc.lookup(keys).tiers, ["l3", "l3"])
            r = b.retrieve(1, keys, 0)
            self.assertTrue(r["ok"], r)
            self.assertEqual(r["wrong_bytes"], 0)
            # the wrong password: L1 works, L3 does not
            r = c.store(1, prompt_keys(91, 2), 0)
            self.assertTrue(r["ok"], r)
            with scheduler(bad) as sc:
                self.assertEqual(sc.lookup(prompt_keys(91, 2)).tiers, ["l1", "l1"])
                self.assertEqual(sc.lookup(keys).hits, 0)
            st = bad.stats()
            print("wrong password:", {k: v for k, v in l3lib.l3_stats(st).items() if v})
            self.assertEqual(st.get("l3_connected"), 0)
            self.assertEqual(st.get("l3_writes"), 0)
        finally:
            for r in ranks:
                r.close()
            for s in srvs:
                s.stop()
                s.cleanup()
            rc.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
