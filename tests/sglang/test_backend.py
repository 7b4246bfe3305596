#!/usr/bin/python3
"""kvside.sglang.KvsideStorage (worker/python/kvside/sglang/) driven in
SGLang's call order: the stand-in ``sglang`` package (tests/sglang/stub, each
module citing the SGLang file and commit it mirrors) creates it through
SGLang's dynamic backend factory and calls it as HiCacheController does;
real kvside servers; two TP rank processes (tests/sglang/sglang_rank.py) with
torch.distributed (gloo) as the TP group.

Cases:
- two TP ranks, four host pools each (MHA layer_first, page_first,
  page_first_direct; MLA page_first; SGLang's "shm" memfd allocator and its
  default shared anonymous mapping): pages set, exists, get byte-exact into
  other host-pool pages (every other page untouched), a shared prefix, a
  partial hit, a miss; a set only one rank sends never becomes visible; the
  server restarted, pages found and fetched byte-exact again from L2;
- hybrid models through the stand-in HybridCacheController (SGLang's v2
  interface), two TP ranks: an MHA model with Mamba states and an SWA pool,
  an MLA model with Mamba states and a KV-derived indexer pool; write-throughs
  with states and windows at some page ends, prefetches whose prefix every
  pool's hit policy must allow, every KV / indexer / state / window page
  byte-exact and every other page untouched, again after a restart from L2;
- one rank in-process: bad configuration and bad inputs give clear errors,
  unknown pages are misses, the pool is refused without
  --allow-unsealed-memory (with a message naming it) and when it is anonymous
  memory, a logical anchor and DeepSeek V4 pools are refused, bad v2
  transfers are refused, Mamba states with a trailing window of two, a prefix
  each pool alone allows but not all together;
- the backend's methods against SGLang's interface at the commit named in
  tests/sglang/sglang_api.txt (and the stand-in against the same list).

Debian's python3 with python3-torch; exit 77 when torch cannot be imported.
Environment: KVSIDE_LIB, KVS_SERVER; PYTHONPATH as tests/sglang/meson.build
sets it (the test also adds the paths itself).
"""

import dataclasses
import inspect
import multiprocessing
import os
import re
import sys
import time
import unittest

try:
    import torch
except ImportError as e:
    print("SKIP: torch cannot be imported (%s)" % e)
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "worker", "python"), os.path.join(HERE, "..", "python"),
          os.path.join(HERE, "stub"), HERE):
    p = os.path.normpath(p)
    if p not in sys.path:
        sys.path.insert(0, p)

import kvside  # noqa: E402
from kvt_server import Server as _Server  # noqa: E402
import sglang_rank as R  # noqa: E402

SERVER = os.environ.get("KVS_SERVER")
API_FILE = os.path.join(HERE, "sglang_api.txt")
PAGE = R.PAGE


def Server(*extra, l2=False):
    """kvside-server in a private run directory; stop and start again keep
    the L2 directory (tests/python/kvt_server.py)."""
    return _Server(*extra, l2=l2, prefix="kvt-sglang-srv-")


def extra_config(srv, **kw):
    cfg = {"backend_name": "kvside", "module_path": "kvside.sglang", "class_name": "KvsideStorage",
           "interface_v1": 1, "broker_dir": srv.run}
    cfg.update(kw)
    return cfg


class Ranks:
    """The TP rank processes (spawned: each imports torch and the stand-in
    afresh, as SGLang's scheduler processes do)."""

    def __init__(self, world, extra, tmp):
        ctx = multiprocessing.get_context("spawn")
        init_file = os.path.join(tmp, "dist-init")
        self.conns, self.procs = [], []
        for r in range(world):
            a, b = ctx.Pipe()
            p = ctx.Process(target=R.main, args=(r, world, b, init_file, extra), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)

    def call(self, cmd, arg=None, timeout=60):
        for c in self.conns:
            c.send((cmd, arg))
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(timeout):
                raise AssertionError("rank %d: no answer to %s within %d s" % (r, cmd, timeout))
            status, res = c.recv()
            if status != "ok":
                raise AssertionError("rank %d failed in %s:\n%s" % (r, cmd, res))
            out.append(res)
        return out

    def close(self):
        try:
            self.call("quit", timeout=20)
        except (AssertionError, OSError, EOFError):
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class TwoRanks(unittest.TestCase):
    def test_tp2_set_exists_get_then_restart_from_l2(self):
        srv = Server("--allow-unsealed-memory", "true", "--job-deadline-ms", "3000", l2=True)
        srv.start()
        ranks = None
        try:
            ranks = Ranks(2, extra_config(srv, store_wait_ms=8000), srv.tmp)
            self.run_phases(srv, ranks)
        except BaseException:
            sys.stderr.write("server log:\n" + srv.log_tail())
            raise
        finally:
            if ranks is not None:
                ranks.close()
            self.assertEqual(srv.stop(), 0, srv.log_tail())
            srv.cleanup()

    def run_phases(self, srv, ranks):
        info = ranks.call("attach")
        for name, mla, layout, alloc in R.SPECS:
            a, b = info[0][name], info[1][name]
            self.assertEqual(a["ns"], b["ns"], "%s: both ranks derive one namespace" % name)
            self.assertEqual(a["world"], 1 if mla else 2, name)
            if mla:
                self.assertNotEqual(a["engine"], b["engine"], "MLA: each rank is its own world")
            else:
                self.assertEqual(a["engine"], b["engine"], "%s: both ranks agree on the engine" % name)
        self.assertEqual(len({info[0][s[0]]["ns"] for s in R.SPECS}), len(R.SPECS), "a namespace per layout")

        p1 = R.tokens(1, 140)                       # two SGLang storage batches (128 + 12 pages)
        p2 = R.tokens(2, 60, base=p1[:40 * PAGE])   # shares p1's first 40 pages
        p3 = R.tokens(3, 130, base=p1[:100 * PAGE])  # p1's first 100 pages, then 30 never stored
        p4 = R.tokens(4, 20)                        # never stored
        done = ranks.call("store", [p1, p2])
        for name, mla, _, _ in R.SPECS:
            self.assertEqual(done[0][name], [140 * PAGE, 60 * PAGE], name)
            # MLA: SGLang backs up from TP rank 0 only (backup_skip)
            self.assertEqual(done[1][name], [0, 0] if mla else [140 * PAGE, 60 * PAGE], name)
        # each rank's set is one message: the part carries its complete
        for r, res in enumerate(ranks.call("stats")):
            for name, st in res.items():
                self.assertEqual(st["set_messages"], st["sets"], "rank %d %s: %s" % (r, name, st))
            self.assertGreater(sum(st["sets"] for st in res.values()), 0, res)

        want = [140, 60, 100, 0]
        for r, res in enumerate(ranks.call("exists", [p1, p2, p3, p4])):
            for name in res:
                self.assertEqual(res[name], want, "rank %d %s exists" % (r, name))
        self.check_fetch(ranks, [p1, p2, p3, p4], want, "L1")

        # a set only TP rank 0 sends: the job waits for rank 1 until the
        # server's deadline, aborts, and no page becomes visible to anyone
        p5 = R.tokens(5, 8)
        solo = ranks.call("solo_store", {"pool": "mha-lf", "tokens": p5})
        self.assertEqual(solo[0]["done"], 0, "a set without every rank's part fails")
        self.assertGreater(solo[0]["s"], 2.0, "it ended at the server's deadline")
        for r, res in enumerate(ranks.call("exists", [p5])):
            self.assertEqual(res["mha-lf"], [0], "rank %d sees nothing of the aborted set" % r)

        # the server restarts from L2: every page written behind is found and
        # fetched byte-exact again
        deadline = time.time() + 20
        while True:
            st = srv.stats()
            if st["l2_queue_depth"] == 0 and st["l2_objects"] > 0:
                break
            self.assertLess(time.time(), deadline, "L2 write-behind did not drain: %s" % st)
            time.sleep(0.1)
        objects = st["l2_objects"]
        self.assertEqual(srv.stop(), 0, srv.log_tail())
        srv.start()
        self.assertEqual(srv.stats()["l1_objects"], 0)
        for res in ranks.call("wait_reconnect", 20):
            for name, n in res.items():
                self.assertGreaterEqual(n, 1, "%s did not re-register after the restart" % name)
        for r, res in enumerate(ranks.call("exists", [p1, p2, p4])):
            for name in res:
                self.assertEqual(res[name], [140, 60, 0], "rank %d %s exists after restart" % (r, name))
        self.check_fetch(ranks, [p1, p2], [140, 60], "L2")
        st = srv.stats()
        self.assertGreater(st["l2_promotions"], 0, st)
        self.assertEqual(st["l2_promotion_failures"], 0, st)
        # 160 distinct pages (p2 shares 40 of p1's): per rank for the 3 MHA
        # pools, once for the MLA pool
        self.assertGreaterEqual(objects, 3 * 2 * 160 + 160, "every rank's pages of every pool written behind")

    def check_fetch(self, ranks, prompts, want, tier):
        for r, res in enumerate(ranks.call("fetch", prompts)):
            for name, outs in res.items():
                for i, (o, w) in enumerate(zip(outs, want)):
                    what = "rank %d %s prompt %d (%s)" % (r, name, i, tier)
                    self.assertEqual(o["hit"], w * PAGE, what + " hit")
                    self.assertEqual(o["done"], w * PAGE, what + " fetched")
                    self.assertEqual(o["bad_pages"], [], what + ": pages not byte-exact")
                    self.assertEqual(o["touched_pages"], [], what + ": other pages written")


class TwoRanksHybrid(unittest.TestCase):
    """Hybrid models through SGLang's HybridCacheController and the v2
    interface: an MHA model with Mamba states and an SWA pool, and an MLA
    model with Mamba states and a KV-derived (DSA-style) indexer pool."""

    # write-throughs of three nodes: prompt, KV pages [lo, hi), Mamba states
    # after these page counts, SWA pages (MHA model only)
    def test_tp2_hybrid_set_exists_get_then_restart_from_l2(self):
        srv = Server("--allow-unsealed-memory", "true", "--job-deadline-ms", "3000", l2=True)
        srv.start()
        ranks = None
        try:
            ranks = Ranks(2, extra_config(srv, store_wait_ms=8000), srv.tmp)
            self.run_phases(srv, ranks)
        except BaseException:
            sys.stderr.write("server log:\n" + srv.log_tail())
            raise
        finally:
            if ranks is not None:
                ranks.close()
            self.assertEqual(srv.stop(), 0, srv.log_tail())
            srv.cleanup()

    def run_phases(self, srv, ranks):
        info = ranks.call("hybrid_attach")
        for name, mla in R.HYBRID_SPECS:
            a, b = info[0][name], info[1][name]
            side = "indexer" if mla else "swa"
            self.assertEqual(sorted(a), sorted(["kv", "mamba", side]), name)
            for pool in a:
                self.assertEqual(a[pool]["ns"], b[pool]["ns"], "%s %s: one namespace on both ranks" % (name, pool))
            self.assertEqual(len({a[pool]["ns"] for pool in a}), 3, "%s: a namespace per pool" % name)
            self.assertEqual(a["mamba"]["kind"], "recurrent", name)
            self.assertEqual(a[side]["kind"], "attention", name)
            # Mamba states are TP-sharded in both models: one world of 2
            self.assertEqual((a["mamba"]["world"], a["mamba"]["engine"]), (2, b["mamba"]["engine"]), name)
            for pool in ("kv", side):
                if mla:  # rank-replicated: each rank a world of one, reading TP rank 0's objects
                    self.assertEqual(a[pool]["world"], 1, name)
                    self.assertNotEqual(a[pool]["engine"], b[pool]["engine"], name)
                else:
                    self.assertEqual(a[pool]["world"], 2, name)
                    self.assertEqual(a[pool]["engine"], b[pool]["engine"], name)

        p1 = R.tokens(11, 20)
        p2 = R.tokens(12, 12, base=p1[:8 * PAGE])    # p1's first 8 pages, then 4 of its own
        p3 = R.tokens(13, 20, base=p1[:16 * PAGE])   # p1's first 16 pages, then 4 never stored
        p4 = R.tokens(14, 6)                         # never stored
        ops = [{"tokens": p1, "pages": (0, 12), "states": [8, 12], "swa": [6, 7, 10, 11]},
               {"tokens": p1, "pages": (12, 20), "states": [20], "swa": [18, 19]},
               {"tokens": p2, "pages": (8, 12), "states": [12]}]          # no SWA window stored
        done = ranks.call("hybrid_store", ops)
        for r in range(2):
            for name, mla in R.HYBRID_SPECS:
                for op, res in zip(ops, done[r][name]):
                    n = op["pages"][1] - op["pages"][0]
                    self.assertEqual(res["done"], n * PAGE, "rank %d %s %s" % (r, name, op["pages"]))
                    want = {"mamba": len(op["states"])}
                    if not mla and op.get("swa"):
                        want["swa"] = len(op["swa"])
                    if mla and r == 0:
                        want["indexer"] = n  # TP rank 0 only (SGLang's should_backup)
                    self.assertEqual(res["pools"], want, "rank %d %s %s" % (r, name, op["pages"]))

        # MHA: p2's window at 12 pages is missing, so its prefix falls back to
        # the state after 8 pages (window 6..7 stored with p1); p3 diverges
        # from p1 after 16 pages, the last state at or before is after 12
        want = {"hyb-mha": [20, 12, 8, 0], "hyb-mla": [20, 12, 12, 0]}
        self.check_fetch(ranks, [p1, p3, p2, p4], want, "L1")

        deadline = time.time() + 20
        while True:
            st = srv.stats()
            if st["l2_queue_depth"] == 0 and st["l2_objects"] > 0:
                break
            self.assertLess(time.time(), deadline, "L2 write-behind did not drain: %s" % st)
            time.sleep(0.1)
        self.assertEqual(srv.stop(), 0, srv.log_tail())
        srv.start()
        self.assertEqual(srv.stats()["l1_objects"], 0)
        for res in ranks.call("hybrid_wait_reconnect", 20):
            for name, pools in res.items():
                for pool, n in pools.items():
                    self.assertGreaterEqual(n, 1, "%s %s did not re-register after the restart" % (name, pool))
        self.check_fetch(ranks, [p1, p3, p2], {k: v[:3] for k, v in want.items()}, "L2")
        st = srv.stats()
        self.assertGreater(st["l2_promotions"], 0, st)
        self.assertEqual(st["l2_promotion_failures"], 0, st)

    def check_fetch(self, ranks, prompts, want, tier):
        for r, res in enumerate(ranks.call("hybrid_fetch", prompts)):
            for name, outs in res.items():
                mla = dict(R.HYBRID_SPECS)[name]
                for i, (o, w) in enumerate(zip(outs, want[name])):
                    what = "rank %d %s prompt %d (%s)" % (r, name, i, tier)
                    self.assertEqual(o["hit"], w * PAGE, what + " hit")
                    self.assertEqual(o["done"], w * PAGE, what + " fetched")
                    self.assertEqual(o["pool_hits"], {} if not w else
                                     {"mamba": 1} if mla else {"mamba": 1, "swa": R.SWA_WINDOW}, what)
                    self.assertEqual(o["bad"], [], what + ": pages not byte-exact")
                    self.assertEqual(o["touched"], [], what + ": other pages written")


class OneRank(unittest.TestCase):
    """tp_size 1 in this process (no torch.distributed needed)."""

    @classmethod
    def setUpClass(cls):
        cls.srv = Server("--allow-unsealed-memory", "true")
        cls.srv.start()

    @classmethod
    def tearDownClass(cls):
        rc = cls.srv.stop()
        cls.srv.cleanup()
        assert rc == 0, "server exit status %s" % rc

    def pool(self, layout="page_first", allocator="shm"):
        from sglang.srt.mem_cache.pool_host import MHATokenToKVPoolHost
        return MHATokenToKVPoolHost(64 * PAGE, PAGE, layout, torch.float16, layer_num=2, head_num=2, head_dim=8,
                                    allocator_type=allocator)

    def controller(self, pool, srv=None, **kw):
        from sglang.srt.managers.cache_controller import HiCacheController
        return HiCacheController(pool, PAGE, None, storage_backend="dynamic", model_name="m",
                                 storage_backend_extra_config=extra_config(srv or self.srv, **kw))

    def test_configuration_errors(self):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from kvside.sglang import KvsideStorage

        def cfg(extra, **kw):
            base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                        model_name="m", extra_config=extra)
            base.update(kw)
            return HiCacheStorageConfig(**base)
        ok = extra_config(self.srv)
        cases = [
            ({k: v for k, v in ok.items() if k != "interface_v1"}, {}, "interface_v1"),
            (dict(ok, interface_v1=0), {}, "interface_v1"),
            (dict(ok, brokerdir="/x"), {}, "unknown --hicache-storage-backend-extra-config key(s) brokerdir"),
            (dict(ok, timeout_ms="5"), {}, "timeout_ms must be a non-negative integer"),
            (dict(ok, prefetch=1), {}, "prefetch must be true or false"),
            (dict(ok, load_timeout_ms=0), {}, "load_timeout_ms must be positive"),
            (dict(ok, pin_ms=700000), {}, "pin_ms must be at most"),
            (dict(ok, namespace="x" * 129), {}, "namespace must be 1..128 bytes"),
            (ok, {"should_split_heads": True, "tp_lcm_size": 2}, "heterogeneous TP"),
            (ok, {"tp_rank": 2, "tp_size": 2}, "tp_rank 2 outside tp_size 2"),
            (ok, {"tp_rank": 1, "tp_size": 2}, "torch.distributed is not initialized"),
        ]
        for extra, kw, msg in cases:
            with self.assertRaises((ValueError, RuntimeError), msg=msg) as e:
                KvsideStorage(cfg(extra, **kw), {})
            self.assertIn(msg, str(e.exception))
        # SGLang's own keys pass through
        b = KvsideStorage(cfg(dict(ok, allocator="shm", tp_lcm_size=None)), {})
        self.assertIsNone(b.client)
        with self.assertRaisesRegex(RuntimeError, "before register_mem_pool_host"):
            b.batch_exists(["a"])

    def test_bad_inputs_and_misses(self):
        pool = self.pool()
        ctl = self.controller(pool)
        b = ctl.storage_backend
        try:
            self.assertIs(ctl.page_get_func.__func__, type(ctl)._page_get_zero_copy, "interface_v1 selected")
            host = pool.alloc(3 * PAGE)
            with self.assertRaisesRegex(TypeError, "list of SGLang page hashes"):
                b.batch_exists("abc")
            with self.assertRaisesRegex(TypeError, "non-empty string"):
                b.batch_exists(["a", 7])
            with self.assertRaisesRegex(ValueError, "exceed kvside's 4096"):
                b.batch_exists(["k%d" % i for i in range(4097)])
            with self.assertRaisesRegex(ValueError, r"12 host indices for 2 pages of 4 tokens \(need 8\)"):
                b.batch_set_v1(["a", "b"], host)
            with self.assertRaisesRegex(ValueError, "not whole pages"):
                b.batch_get_v1(["a"], host[1:1 + PAGE])
            with self.assertRaisesRegex(ValueError, "not whole pages"):
                b.batch_get_v1(["a", "b"], torch.cat([host[:PAGE], host[:PAGE].flip(0)]))
            with self.assertRaisesRegex(ValueError, "outside the registered pool"):
                b.batch_get_v1(["a"], torch.arange(pool.size, pool.size + PAGE))
            with self.assertRaisesRegex(TypeError, "must hold integers"):
                b.batch_get_v1(["a"], host[:PAGE].float())
            self.assertEqual(b.batch_get_v1([], host[:0]), [])
            # unknown pages: misses, and the pages are not written
            pool.kv_buffer.view(torch.int16)[:] = 7
            before = pool.kv_buffer.clone()
            self.assertEqual(b.batch_exists(["nope-1", "nope-2"]), 0)
            self.assertFalse(b.exists("nope-1"))
            self.assertEqual(b.batch_get_v1(["nope-1", "nope-2"], host[:2 * PAGE]), [False, False])
            self.assertTrue(torch.equal(pool.kv_buffer.view(torch.int16), before.view(torch.int16)))
            # a set then a get of one page, host list given as a plain list
            self.assertEqual(b.batch_set_v1(["p0"], host[:PAGE].tolist()), [True])
            self.assertEqual(b.batch_exists(["p0", "nope-1"]), 1)
            self.assertEqual(b.batch_get_v1(["p0", "nope-1"], host[PAGE:3 * PAGE]), [True, False])
            for name in ("get", "set", "batch_get", "batch_set"):
                with self.assertRaisesRegex(NotImplementedError, "interface_v1"):
                    getattr(b, name)("k", None)
            b.register_mem_host_pool_v2(pool, "kv")  # the KV pool itself: accepted
            with self.assertRaisesRegex(ValueError, "not the host pool register_mem_pool_host registered"):
                b.register_mem_host_pool_v2(self.pool(), "kv")
            r = b.batch_exists_v2(["p0", "nope-1"])  # no side pools: the KV prefix
            self.assertEqual((r.kv_hit_pages, r.extra_pool_hit_pages), (1, {"kv": 1}))
            with self.assertRaisesRegex(RuntimeError, "already registered"):
                b.register_mem_pool_host(pool)
            b.clear()  # not forwarded: the page stays
            self.assertTrue(b.exists("p0"))
            self.assertIsNone(b.get_stats())
        finally:
            b.close()

    def test_pool_memory_refused(self):
        from sglang.srt.mem_cache.pool_host import MHATokenToKVPoolHost
        # anonymous memory (plain torch tensors): nothing the server can map
        pool = MHATokenToKVPoolHost(16 * PAGE, PAGE, "page_first", torch.float16, layer_num=1, head_num=1,
                                    head_dim=8)
        pool.kv_buffer = torch.zeros_like(pool.kv_buffer)
        with self.assertRaisesRegex(ValueError, "anonymous memory"):
            self.controller(pool)
        # SGLang's memfd cannot be sealed against shrinking: refused unless
        # the server runs with --allow-unsealed-memory, and the error says so
        strict = Server()
        strict.start()
        try:
            with self.assertRaisesRegex(RuntimeError, "--allow-unsealed-memory true"):
                self.controller(self.pool(), srv=strict)
        finally:
            self.assertEqual(strict.stop(), 0)
            strict.cleanup()
        # a logical anchor pool (DeepSeek V4) holds no KV buffer
        anchor = self.pool()
        anchor.kv_buffer = None
        with self.assertRaisesRegex(ValueError, "logical anchor"):
            self.controller(anchor)

    def test_hybrid_one_rank_inputs_and_states(self):
        """The v2 interface in-process: refused pools and transfers, and
        Mamba states (a recurrent group) with a trailing window of 2."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.pool_host import HostPoolGroup, MambaPoolHost, PoolEntry
        kv = self.pool()
        mamba = MambaPoolHost(2, [(3, 4)], (2, 3), torch.float16, torch.float32, host_size=8,
                              allocator_type="shm")
        swa = self.pool(layout="layer_first")
        group = HostPoolGroup([PoolEntry(PoolName.KV, kv, None, None, is_primary_index_anchor=True),
                               PoolEntry(PoolName.MAMBA, mamba, None, None),
                               PoolEntry(PoolName.SWA, swa, None, None)])
        ctl = HybridCacheController(group, PAGE, None, storage_backend="dynamic", model_name="m",
                                    storage_backend_extra_config=extra_config(self.srv))
        b = ctl.storage_backend
        T = PoolTransfer
        try:
            self.assertEqual(sorted(b.regs), ["kv", "mamba", "swa"])
            self.assertEqual(b.regs["mamba"].kind, "recurrent")
            with self.assertRaisesRegex(ValueError, "DeepSeek V4"):
                b.register_mem_host_pool_v2(self.pool(), PoolName.DEEPSEEK_V4_C4)
            with self.assertRaisesRegex(ValueError, "page_size 4: SGLang's Mamba host pool holds one state per"):
                b.register_mem_host_pool_v2(self.pool(), "mamba")
            with self.assertRaisesRegex(ValueError, "another host pool is already registered as 'mamba'"):
                b.register_mem_host_pool_v2(MambaPoolHost(1, [(2,)], (2,), torch.float16, torch.float16,
                                                          host_size=4), PoolName.MAMBA)
            b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)  # again, the same pool: accepted
            with self.assertRaisesRegex(ValueError, "host pool 'draft', which is not registered"):
                b.batch_get_v2([T(PoolName.DRAFT, host_indices=torch.arange(PAGE), keys=["a"])])
            with self.assertRaisesRegex(ValueError, r"3 host indices for 2 pages of 1 tokens \(need 2\) in pool "
                                                    "'mamba'"):
                b.batch_set_v2([T(PoolName.MAMBA, host_indices=torch.arange(3), keys=["a", "b"])])
            with self.assertRaisesRegex(ValueError, "outside the registered pool 'mamba'"):
                b.batch_get_v2([T(PoolName.MAMBA, host_indices=torch.tensor([mamba.size]), keys=["a"])])
            with self.assertRaisesRegex(ValueError, "has no keys"):
                b.batch_set_v2([T(PoolName.MAMBA, host_indices=torch.tensor([0]))])
            with self.assertRaisesRegex(ValueError, "has no host_indices"):
                b.batch_get_v2([T(PoolName.MAMBA, keys=["a"])])
            with self.assertRaisesRegex(ValueError, "must be trailing_pages, not all_pages"):
                b.batch_exists_v2(["a"], [T(PoolName.MAMBA, keys=["a"])])
            with self.assertRaisesRegex(ValueError, "unknown pool hit policy"):
                b.batch_exists_v2(["a"], [T(PoolName.MAMBA, keys=["a"], hit_policy="newest")])
            with self.assertRaisesRegex(TypeError, "pool name must be a non-empty string"):
                b.batch_get_v2([T(None, keys=["a"], host_indices=torch.tensor([0]))])
            # more keys than one kvside request holds: looked up in parts
            r = b.batch_exists_v2(["x%d" % i for i in range(5000)],
                                  [T(PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            self.assertEqual((r.kv_hit_pages, r.extra_pool_hit_pages), (0, {}))

            # 4 KV pages; states after pages 2 and 4; a trailing window of 2
            # states needs the states after n-1 and n pages
            keys = ["s0", "s1", "s2", "s3"]
            host = kv.alloc(4 * PAGE)
            self.assertEqual(b.batch_set_v1(keys, host), [True] * 4)
            slots = mamba.alloc(3)
            for i, slot in enumerate(slots.tolist()):
                for t in (mamba.temporal_buffer[slot], mamba.conv_buffer[0][slot]):
                    u = t.view(torch.uint8)
                    u.copy_((torch.arange(u.numel()) * 7 + i).to(torch.uint8).reshape(u.shape))
            want = [torch.cat([mamba.temporal_buffer[s].view(torch.uint8).flatten(),
                               mamba.conv_buffer[0][s].view(torch.uint8).flatten()]).clone()
                    for s in slots.tolist()]
            self.assertEqual(b.batch_set_v2([T(PoolName.MAMBA, host_indices=slots[:2], keys=["s1", "s3"])]),
                             {PoolName.MAMBA: [True, True]})
            win2 = [T(PoolName.MAMBA, keys=["x", "y"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            win1 = [T(PoolName.MAMBA, keys=["y"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            r = b.batch_exists_v2(keys, win1)
            self.assertEqual((r.kv_hit_pages, r.extra_pool_hit_pages), (4, {"kv": 4, PoolName.MAMBA: 4}))
            self.assertEqual(b.batch_exists_v2(keys[:3], win1).kv_hit_pages, 2)
            self.assertEqual(b.batch_exists_v2(keys, win2).kv_hit_pages, 0)  # states after 3 and 1 missing
            self.assertEqual(b.batch_set_v2([T(PoolName.MAMBA, host_indices=slots[2:], keys=["s2"])]),
                             {PoolName.MAMBA: [True]})
            self.assertEqual(b.batch_exists_v2(keys, win2).kv_hit_pages, 4)
            self.assertEqual(b.batch_exists_v2(keys[:3], win2).kv_hit_pages, 3)
            # states back into other slots, byte-exact; a missing state fails
            dst = mamba.alloc(3)
            mamba.temporal_buffer[dst].view(torch.uint8).fill_(0xEE)
            self.assertEqual(b.batch_get_v2([T(PoolName.MAMBA, host_indices=dst, keys=["s3", "s1", "s2"])]),
                             {PoolName.MAMBA: [True, True, True]})
            for s, w in zip(dst.tolist(), [want[1], want[0], want[2]]):
                got = torch.cat([mamba.temporal_buffer[s].view(torch.uint8).flatten(),
                                 mamba.conv_buffer[0][s].view(torch.uint8).flatten()])
                self.assertTrue(torch.equal(got, w), "state in slot %d not byte-exact" % s)
            self.assertEqual(b.batch_get_v2([T(PoolName.MAMBA, host_indices=dst[:2], keys=["s1", "s0"])]),
                             {PoolName.MAMBA: [True, False]})

            # every pool's rule at one length: 6 KV pages, states after 2 and
            # 4 pages, SWA windows (2 pages) ending at 2 and 6. Each pool alone
            # allows 4 (Mamba) and 6 (SWA), together only 2
            w = ["w%d" % i for i in range(6)]
            host = kv.alloc(6 * PAGE)
            self.assertEqual(b.batch_set_v1(w, host), [True] * 6)
            self.assertEqual(b.batch_set_v2([T(PoolName.MAMBA, host_indices=slots[:2], keys=["w1", "w3"]),
                                             T(PoolName.SWA, host_indices=host[:4 * PAGE],
                                               keys=["w0", "w1", "w4", "w5"])]),
                             {PoolName.MAMBA: [True, True], PoolName.SWA: [True] * 4})
            tr = [T(PoolName.MAMBA, keys=["y"], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                  T(PoolName.SWA, keys=["x", "y"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            r = b.batch_exists_v2(w, tr)
            self.assertEqual((r.kv_hit_pages, r.extra_pool_hit_pages),
                             (2, {"kv": 6, PoolName.MAMBA: 4, PoolName.SWA: 6}))
            # an SWA pool asked for all pages: its leading run
            r = b.batch_exists_v2(w, [T(PoolName.SWA, keys=None)])
            self.assertEqual((r.kv_hit_pages, r.extra_pool_hit_pages), (2, {"kv": 6, PoolName.SWA: 2}))
        finally:
            b.close()


class Api(unittest.TestCase):
    """The backend against SGLang's interface at the commit named in
    sglang_api.txt (and the stand-in against the same list)."""

    @staticmethod
    def parse():
        out = []
        with open(API_FILE) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = re.match(r"((?:@\w+ )*)(\w+)(?:\.(\w+))?\((.*)\)$", line)
                assert m, line
                decos = set(m.group(1).replace("@", "").split())
                params = [p.strip() for p in m.group(4).split(",") if p.strip()]
                out.append((decos, m.group(2), m.group(3), params))
        return out

    @staticmethod
    def params(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()]

    @staticmethod
    def owner(cls, name):
        for k in cls.__mro__:
            if name in k.__dict__:
                return k, k.__dict__[name]
        return None, None

    def test_stub_matches_the_list(self):
        from sglang.srt.mem_cache import hicache_storage as H
        for decos, cname, name, want in self.parse():
            cls = getattr(H, cname)
            if "dataclass" in decos:
                self.assertEqual([f.name for f in dataclasses.fields(cls)], want, cname)
                continue
            if "enum" in decos:
                self.assertEqual(["%s=%s" % (m.name, m.value) for m in cls], want, cname)
                continue
            if "function" in decos:
                self.assertEqual(self.params(cls), want, cname)
                continue
            if "constructor" in decos:
                continue  # SGLang's base class has no __init__; the factory's call is checked below
            owner, fn = self.owner(cls, name)
            self.assertIs(owner, cls, "stand-in %s lacks %s" % (cname, name))
            if isinstance(fn, classmethod):
                fn = fn.__func__
            self.assertEqual(self.params(fn), want, "stand-in %s.%s parameters" % (cname, name))
            self.assertEqual(name in getattr(cls, "__abstractmethods__", ()), "abstractmethod" in decos, name)

    def test_backend_keeps_sglang_api(self):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from kvside.sglang import KvsideStorage
        self.assertTrue(issubclass(KvsideStorage, HiCacheStorage))
        self.assertEqual(sorted(KvsideStorage.__abstractmethods__), [], "abstract methods left undefined")
        self.assertIs(StorageBackendFactory._load_backend_class("kvside.sglang", "KvsideStorage", "kvside"),
                      KvsideStorage)
        problems = []
        for decos, cname, name, want in self.parse():
            if cname != "HiCacheStorage":
                continue
            owner, fn = self.owner(KvsideStorage, name)
            if "constructor" in decos:
                if self.params(KvsideStorage.__init__)[:3] != want:
                    problems.append("KvsideStorage.__init__%s: the factory calls it as (%s)"
                                    % (tuple(self.params(KvsideStorage.__init__)), ", ".join(want)))
                continue
            if owner is None:
                problems.append("%s missing" % name)
            elif owner is not HiCacheStorage and self.params(fn) != want:
                problems.append("KvsideStorage.%s%s: SGLang's parameters are (%s)"
                                % (name, tuple(self.params(fn)), ", ".join(want)))
            if "abstractmethod" in decos and owner is HiCacheStorage:
                problems.append("%s (abstract in SGLang) is not defined" % name)
        for name in ("batch_exists", "batch_get_v1", "batch_set_v1", "register_mem_pool_host",
                     "register_mem_host_pool_v2", "batch_exists_v2", "batch_get_v2", "batch_set_v2"):
            if self.owner(KvsideStorage, name)[0] is not KvsideStorage:
                problems.append("%s is not overridden" % name)
        self.assertEqual(problems, [], "\n".join(problems))
        # every pool name of the pinned SGLang is either served or refused by
        # name (DeepSeek V4's), and the hit policies are the two it knows
        import kvside.sglang.hybrid as KS
        names = [p for decos, c, _, p in self.parse() if "enum" in decos and c == "PoolName"][0]
        values = [p.split("=")[1] for p in names]
        self.assertEqual(sorted(v for v in values if v.startswith(KS._REFUSED_PREFIX)),
                         sorted(v for v in values if v.startswith("deepseek_v4")))
        self.assertIn(KS.KV, values)
        self.assertIn(KS.MAMBA, values)
        policies = [p for decos, c, _, p in self.parse() if "enum" in decos and c == "PoolHitPolicy"][0]
        self.assertEqual(sorted(p.split("=")[1] for p in policies), sorted([KS.ALL_PAGES, KS.TRAILING_PAGES]))
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
        self.assertIs(KS.PoolTransferResult, PoolTransferResult, "batch_exists_v2 answers SGLang's own type")


if __name__ == "__main__":
    if not SERVER:
        print("KVS_SERVER is not set")
        sys.exit(1)
    unittest.main(verbosity=2)
