#!/usr/bin/python3
"""The L3 tier under cluster changes during traffic (issue 17): rank A stores
fresh prompts through server 1 while rank B, on server 2, looks each up and
retrieves it from L3. (1) A range of slots is resharded to another master
under that traffic (MOVED/ASK followed): 0 wrong bytes, and every prompt
stored before the reshard whose keys moved is served after it. (2) A master
is SIGKILLed under that traffic: no request waits beyond its time-out, 0
wrong bytes, and after the replica's promotion both servers keep serving
from L3 (fresh prompts hit "l3" and are retrieved byte-exact).

Misses are allowed while the cluster changes (a lookup answers from L1/L2
when L3 is slow or down; a write behind to a dead master fails); wrong bytes
never are.

PrestoredFailoverTest (issue 33 #2), on a cluster of its own: chunks stored
and seen as L3 hits on server 2 before a master is SIGKILLed, replicas caught
up, are all retrieved byte-exact from server 2 within 5 s of the cluster
reporting the new topology, by retrieves alone (no new lookup: a read that
failed during the failover must not make the server forget what the
promoted replica holds), and then looked up as L3 hits."""

import subprocess
import threading
import time
import unittest

import l3lib
from l3lib import Rank, delta, l3_server, prompt_keys, scheduler

LAYERS, BLOCK = 2, 16 << 10
N = 2                           # chunks per prompt
CLIENT_MS = 5000                # the ranks' and scheduler's request time-out
LOOKUP_BOUND, RETRIEVE_BOUND, STORE_BOUND = 1.0, 2.5, 2.5   # liveness bounds (s), not performance claims


def two_servers(cls, prefix1, prefix2):
    """A cluster of its own, two servers on it, rank A on server 1 and rank B on server 2."""
    l3lib.skip_unless_ready()
    cls.rc = l3lib.start_cluster()
    cls.s1 = l3_server(cls.rc.seeds, l1_size="256M", prefix=prefix1)
    cls.s2 = l3_server(cls.rc.seeds, l1_size="256M", prefix=prefix2)
    cls.s1.start()
    cls.s2.start()
    cls.a = Rank(cls.s1, "eng-a", LAYERS, 64, BLOCK, timeout_ms=CLIENT_MS)
    cls.b = Rank(cls.s2, "eng-b", LAYERS, 64, BLOCK, timeout_ms=CLIENT_MS)


class Traffic:
    """Fresh prompts stored through s1 by A, looked up and retrieved through s2 by B."""

    def __init__(self, t, first_prompt):
        self.t, self.prompt, self.job = t, first_prompt, first_prompt * 10
        self.lat = {"store": [], "lookup": [], "retrieve": []}
        self.codes = []
        self.wrong = 0
        self.served = self.missed = self.failed = 0

    def one(self, sc, wait_s=1.0):
        t = self.t
        p = self.prompt
        self.prompt += 1
        keys = prompt_keys(p, N)
        self.job += 1
        r = t.a.store(self.job, keys, 0)
        self.lat["store"].append(r.get("t", 0))
        if not r["ok"]:
            self.codes.append(("store", r.get("code")))
        hits, t_end = 0, time.monotonic() + wait_s
        while True:
            t0 = time.monotonic()
            try:
                lk = sc.lookup(keys)
                hits = lk.hits
            except l3lib.kvside.KvsideError as e:
                self.codes.append(("lookup", e.code_name))
                hits = 0
            self.lat["lookup"].append(time.monotonic() - t0)
            if hits == N or time.monotonic() > t_end:
                break
            time.sleep(0.02)
        if not hits:
            self.missed += 1
            return
        self.job += 1
        r = t.b.retrieve(self.job, keys[:hits], 0)
        self.lat["retrieve"].append(r.get("t", 0))
        if r["ok"]:
            self.served += 1
            self.wrong += r["wrong_bytes"]
        else:
            self.failed += 1
            self.codes.append(("retrieve", r.get("code")))
            t.assertTrue(r["untouched"], "failed retrieve wrote the destination: %s" % r)

    def check_bounds(self):
        t = self.t
        for op, bound in (("lookup", LOOKUP_BOUND), ("retrieve", RETRIEVE_BOUND), ("store", STORE_BOUND)):
            v = self.lat[op]
            if v:
                t.assertLessEqual(max(v), bound, "%s waited %.3f s" % (op, max(v)))
        t.assertEqual([c for c in self.codes if c[1] in ("ETIMEDOUT", "E_TIMEOUT")], [], "requests timed out")
        t.assertEqual(self.wrong, 0, "wrong bytes served")

    def summary(self):
        return "served %d missed %d failed %d wrong bytes %d; max lookup %.3f retrieve %.3f store %.3f s; codes %s" % (
            self.served, self.missed, self.failed, self.wrong, max(self.lat["lookup"] or [0]),
            max(self.lat["retrieve"] or [0]), max(self.lat["store"] or [0]), sorted(set(self.codes)))


class FailoverTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        two_servers(cls, "kvt-l3a-", "kvt-l3b-")

    @classmethod
    def tearDownClass(cls):
        l3lib.teardown(cls, ranks=("a", "b"))

    def prestore(self, prompts):
        """Stores prompts through server 1 and waits until L3 has them (server
        1's L1 of 256 MiB caps its write-behind queue at 64 MiB: no drops)."""
        st = self.s1.stats()
        for p in prompts:
            r = self.a.store(p * 10 + 1, prompt_keys(p, N), 0)
            self.assertTrue(r["ok"], r)
        w = l3lib.wait_written(self.s1, st.get("l3_writes", 0) + len(prompts) * N)
        self.assertEqual(delta(w, st, "l3_write_errors") + delta(w, st, "l3_write_drops"), 0)

    def serve_all(self, prompts, job0, deadline_s=8):
        """Every prompt: lookup "l3" hits on server 2 and a byte-exact retrieve
        (retried until deadline_s: the servers may still be learning the map)."""
        bad, job = [], job0
        with scheduler(self.s2, CLIENT_MS) as sc:
            for i, p in enumerate(prompts):
                keys = prompt_keys(p, N)
                t_end = time.monotonic() + deadline_s
                while True:
                    lk = sc.lookup(keys)
                    job += 1
                    r = self.b.retrieve(job, keys, 0) if lk.hits == N else {"ok": False, "code": "lookup %d" % lk.hits}
                    if r["ok"]:
                        self.assertEqual(r["wrong_bytes"], 0)
                        break
                    if time.monotonic() > t_end:
                        bad.append((p, lk.hits, r.get("code")))
                        break
                    time.sleep(0.1)
        return bad

    def test_1_reshard_under_traffic(self):
        before = [p for p in range(1000, 1080)]
        self.prestore(before)
        masters = self.rc.masters_now()
        smap = self.rc.slot_map()
        src, dst = masters[0], masters[1]
        src_slots = [(a, b) for a, b, m, _ in smap if m == src]
        lo = src_slots[0][0]
        nslots = 500
        moved = set(range(lo, lo + nslots))
        src_id, dst_id = self.rc.node_id(src), self.rc.node_id(dst)
        # which prestored objects live in the slots that move
        in_moved = [p for p in before if any(
            self.rc.call(src, "CLUSTER", "KEYSLOT", l3lib.redis_key(l3lib.objkey(k))) in moved
            for k in prompt_keys(p, N))]
        self.assertGreater(len(in_moved), 0)
        st1, st2 = self.s1.stats(), self.s2.stats()
        proc = subprocess.Popen(["redis-cli", "--cluster", "reshard", "127.0.0.1:%d" % src, "--cluster-from", src_id,
                                 "--cluster-to", dst_id, "--cluster-slots", str(nslots), "--cluster-yes"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tr = Traffic(self, 2000)
        with scheduler(self.s2, CLIENT_MS) as sc:
            t0 = time.monotonic()
            while proc.poll() is None or time.monotonic() - t0 < 3:
                tr.one(sc)
                if time.monotonic() - t0 > 60:
                    break
        out = proc.communicate()[0].decode(errors="replace")
        self.assertEqual(proc.returncode, 0, out[-2000:])
        self.assertEqual(self.rc.slot_map_owner(lo), dst, "reshard did not move slot %d" % lo)
        bad = self.serve_all(in_moved, 500000)
        a1, a2 = self.s1.stats(), self.s2.stats()
        print("reshard: %d slots %d -> %d in %.1f s; traffic %s" % (nslots, src, dst, time.monotonic() - t0,
                                                                     tr.summary()))
        print("reshard: %d prestored prompts in moved slots; server 1 moved +%d ask +%d refreshes +%d; "
              "server 2 moved +%d ask +%d refreshes +%d" % (
                  len(in_moved), delta(a1, st1, "l3_moved"), delta(a1, st1, "l3_ask"),
                  delta(a1, st1, "l3_refreshes"), delta(a2, st2, "l3_moved"), delta(a2, st2, "l3_ask"),
                  delta(a2, st2, "l3_refreshes")))
        tr.check_bounds()
        self.assertEqual(bad, [], "prestored prompts in moved slots not served after the reshard")
        self.assertGreater(tr.served, 0, "no traffic served during the reshard")
        self.assertGreater(delta(a2, st2, "l3_moved") + delta(a2, st2, "l3_ask"), 0,
                           "server 2 read moved keys without a redirection")

    def test_1b_ask_mid_migration(self):
        """A slot caught mid-migration: the object's key already MIGRATEd to the
        importing master, the slot still the source's. Server 2's lookup and
        retrieve follow ASK to the new node; then the slot is handed over
        (SETSLOT NODE) and the next read follows MOVED."""
        p = 1500
        self.prestore([p])
        key0 = prompt_keys(p, N)[:1]
        rkey = l3lib.redis_key(l3lib.objkey(key0[0]))
        masters = self.rc.masters_now()
        slot = self.rc.call(masters[0], "CLUSTER", "KEYSLOT", rkey)
        src = self.rc.slot_map_owner(slot)
        dst = next(m for m in masters if m != src)
        sid, did = self.rc.node_id(src), self.rc.node_id(dst)
        try:
            self.rc.call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
            self.rc.call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", did)
            self.assertEqual(self.rc.call(src, "MIGRATE", "127.0.0.1", dst, rkey, 0, 5000), "OK")
            st2 = self.s2.stats()
            with scheduler(self.s2, CLIENT_MS) as sc:
                lk = sc.lookup(key0)
                self.assertEqual((lk.hits, lk.tiers), (1, ["l3"]), "lookup of a key behind ASK")
            r = self.b.retrieve(600001, key0, 0)
            self.assertTrue(r["ok"], r)
            self.assertEqual(r["wrong_bytes"], 0)
            a2 = self.s2.stats()
            print("ask: server 2 ask +%d moved +%d" % (delta(a2, st2, "l3_ask"), delta(a2, st2, "l3_moved")))
            self.assertGreaterEqual(delta(a2, st2, "l3_ask"), 1)
        finally:
            for m in self.rc.masters_now():
                self.rc.call(m, "CLUSTER", "SETSLOT", slot, "NODE", did)
        # handed over: a fresh server-2 read of the same key (L1 of server 2 cleared) goes by MOVED
        with scheduler(self.s2, CLIENT_MS) as sc:
            sc.admin("clear")
            st2 = self.s2.stats()
            t_end = time.monotonic() + 5
            while sc.lookup(key0).hits != 1 and time.monotonic() < t_end:
                time.sleep(0.05)
        r = self.b.retrieve(600002, key0, 0)
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["wrong_bytes"], 0)

    def test_2_master_killed_under_traffic(self):
        before = [p for p in range(3000, 3030)]
        self.prestore(before)
        victim = self.rc.masters_now()[-1]
        st1, st2 = self.s1.stats(), self.s2.stats()
        tr = Traffic(self, 4000)
        killed_at = None
        with scheduler(self.s2, CLIENT_MS) as sc:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 12:
                if killed_at is None and time.monotonic() - t0 > 2:
                    self.rc.kill(victim)
                    killed_at = time.monotonic()
                tr.one(sc)
        self.assertTrue(self.rc.wait_serving(30), "no failover")
        print("failover: master %d killed; traffic %s" % (victim, tr.summary()))
        tr.check_bounds()
        # the prompts acknowledged before the kill: misses allowed (their
        # master may have died before replicating), wrong bytes never
        lost = 0
        with scheduler(self.s2, CLIENT_MS) as sc:
            for i, p in enumerate(before):
                keys = prompt_keys(p, N)
                lk = sc.lookup(keys)
                if lk.hits:
                    r = self.b.retrieve(700000 + i, keys[:lk.hits], 0)
                    if r["ok"]:
                        self.assertEqual(r["wrong_bytes"], 0)
                    else:
                        self.assertTrue(r["untouched"])
                lost += lk.hits < N
        # after the failover: both servers keep serving (fresh prompts)
        fresh = list(range(5000, 5010))
        for i, p in enumerate(fresh):
            r = self.a.store(800000 + i, prompt_keys(p, N), 0)
            self.assertTrue(r["ok"], r)
        bad = self.serve_all(fresh, 900000)
        a1, a2 = self.s1.stats(), self.s2.stats()
        print("failover: %d of %d prompts stored before the kill missed after it; server 1 %s; server 2 %s" % (
            lost, len(before), {k: delta(a1, st1, k) for k in ("l3_write_errors", "l3_nodes_down", "l3_refreshes",
                                                                 "l3_write_drops", "l3_moved")},
            {k: delta(a2, st2, k) for k in ("l3_probe_errors", "l3_read_errors", "l3_lookup_timeouts",
                                            "l3_nodes_down", "l3_refreshes")}))
        self.assertEqual(bad, [], "not served from L3 after the failover")
        self.assertGreater(tr.served, 0)


class PrestoredFailoverTest(unittest.TestCase):
    CHUNKS = 24
    SERVE_BOUND_S = 5.0         # after the cluster reports the new topology

    @classmethod
    def setUpClass(cls):
        two_servers(cls, "kvt-l3c-", "kvt-l3d-")

    @classmethod
    def tearDownClass(cls):
        l3lib.teardown(cls, ranks=("a", "b"))

    def replicas_caught_up(self, timeout=10):
        """Every replica's offset equals its master's (WAIT counts only the
        writes of the connection that sends it, not the servers')."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            lag = []
            for m in self.rc.masters_now():
                info = dict(x.split(":", 1) for x in self.rc.call(m, "INFO", "replication").decode().splitlines()
                            if ":" in x)
                off = int(info["master_repl_offset"])
                for k, v in info.items():
                    if k.startswith("slave") and k[5:].isdigit():
                        f = dict(x.split("=", 1) for x in v.split(","))
                        if int(f["offset"]) != off:
                            lag.append((m, f["port"], off - int(f["offset"])))
                if not any(k.startswith("slave") and k[5:].isdigit() for k in info):
                    lag.append((m, "no replica", 0))
            if not lag:
                return
            time.sleep(0.1)
        self.fail("replicas not caught up: %s" % lag)

    def test_prestored_chunks_served_after_failover(self):
        prompts = list(range(100, 100 + self.CHUNKS))   # one chunk each
        st = self.s1.stats()
        for p in prompts:
            r = self.a.store(p * 10 + 1, prompt_keys(p, 1), 0)
            self.assertTrue(r["ok"], r)
        w = l3lib.wait_written(self.s1, st.get("l3_writes", 0) + len(prompts))
        self.assertEqual(delta(w, st, "l3_write_errors") + delta(w, st, "l3_write_drops"), 0)
        # seen by server 2 as L3 hits (learned), never retrieved there before the kill
        with scheduler(self.s2, CLIENT_MS) as sc:
            for p in prompts:
                t_end = time.monotonic() + 5
                while sc.lookup(prompt_keys(p, 1)).tiers != ["l3"] and time.monotonic() < t_end:
                    time.sleep(0.05)
                self.assertEqual(sc.lookup(prompt_keys(p, 1)).tiers, ["l3"], "prompt %d before the kill" % p)
        self.replicas_caught_up()
        smap = self.rc.slot_map()

        def owner(p):
            slot = self.rc.call(self.rc.alive()[0], "CLUSTER", "KEYSLOT",
                                l3lib.redis_key(l3lib.objkey(prompt_keys(p, 1)[0])))
            return next(m for a, b, m, _ in smap if a <= slot <= b)
        per = {}
        for p in prompts:
            per.setdefault(owner(p), []).append(p)
        victim = max(per, key=lambda m: len(per[m]))
        on_victim = per[victim]
        st2 = self.s2.stats()
        self.rc.kill(victim)
        t_kill = time.monotonic()
        # retrieves of the victim's chunks during the failover (they fail:
        # the master is gone), until the cluster reports the new topology
        job, t_ok = 1000, None
        while time.monotonic() - t_kill < 30 and t_ok is None:
            for p in on_victim:
                job += 1
                r = self.b.retrieve(job, prompt_keys(p, 1), 0, timeout_ms=2000)
                if not r["ok"]:
                    self.assertTrue(r["untouched"], r)
            if self.rc.wait_serving(0.05):
                t_ok = time.monotonic()
            time.sleep(0.1)
        self.assertIsNotNone(t_ok, "no failover within 30 s")
        mid = self.s2.stats()
        self.assertGreater(delta(mid, st2, "l3_read_errors"), 0, "no read met the failover: the test proves nothing")
        # the records are on the promoted replica (else the loss is Redis's, not kvside's)
        absent = [p for p in on_victim if not self.rc.route(
            "EXISTS", l3lib.redis_key(l3lib.objkey(prompt_keys(p, 1)[0])))]
        self.assertEqual(absent, [], "records missing on the new master")
        # every chunk served again by retrieves alone within the bound
        pending, served_at = list(prompts), {}
        while pending and time.monotonic() - t_ok < self.SERVE_BOUND_S + 2:
            for p in list(pending):
                job += 1
                r = self.b.retrieve(job, prompt_keys(p, 1), 0, timeout_ms=2000)
                if r["ok"]:
                    self.assertEqual(r["wrong_bytes"], 0)
                    served_at[p] = time.monotonic() - t_ok
                    pending.remove(p)
            time.sleep(0.1)
        late = {p: round(t, 2) for p, t in served_at.items() if t > self.SERVE_BOUND_S}
        a2 = self.s2.stats()
        print("prestored failover: master %d killed, %d of %d chunks on it, cluster ok %.1f s after the kill; "
              "never served %s, served later than %.0f s %s, last served %.2f s after ok; server 2 %s" % (
                  victim, len(on_victim), len(prompts), t_ok - t_kill, pending, self.SERVE_BOUND_S, late,
                  max(served_at.values() or [0]),
                  {k: delta(a2, st2, k) for k in ("l3_read_errors", "l3_read_misses", "l3_refreshes",
                                                  "l3_nodes_down", "l3_probe_hits")}))
        self.assertEqual(pending, [], "chunks stored before the kill never served again by retrieves")
        self.assertEqual(late, {}, "chunks served later than the bound")
        with scheduler(self.s2, CLIENT_MS) as sc:
            for p in prompts:
                self.assertEqual(sc.lookup(prompt_keys(p, 1)).hits, 1, "prompt %d after the failover" % p)


def _slot_map_owner(self, slot):
    return next(m for a, b, m, _ in self.slot_map() if a <= slot <= b)


l3lib.Cluster.slot_map_owner = _slot_map_owner

if __name__ == "__main__":
    unittest.main(verbosity=2)
