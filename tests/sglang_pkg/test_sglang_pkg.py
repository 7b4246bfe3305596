"""kvside.sglang.KvsideStorage inside the real SGLang (issue 32): sglang 0.5.23
from PyPI (tests/sglang_pkg/requirements.txt, its own virtual environment),
real kvside servers.

SGLang's own code does the work: its HiCacheStorageConfig, its
StorageBackendFactory loading the backend through "dynamic" with the README's
extra config, its host KV pools (MHATokenToKVPoolHost in every layout,
MLATokenToKVPoolHost) allocated by its own allocators ("shm" and its
default) and its own host-page allocator (pool.alloc), the calls in
HiCacheController's order and with its arguments (batch_exists with
extra_info, batch_get_v1 / batch_set_v1 with host indices and extra_info),
pages compared through the pool's own get_data_page.

Substitutes, and why:
- the device pools: SGLang builds a host pool from the device pool's
  buffers (MHABufferInfo / MLABufferInfo). Its device pools need CUDA, so
  the buffers here are CPU tensors of the same shapes; the host pool never
  copies from them in these tests (the storage calls move host pages only).
- torchvision (tests/sglang/shim): imported by SGLang's multimodal configs
  at module level; PyPI's wheels are CUDA builds that do not load beside
  torch 2.13.0+cpu. transformers is asked first, so it caches "no
  torchvision" and never imports the stand-in.

Cases:
- every MHA layout (layer_first, page_first, page_first_direct, page_head)
  with both allocators: pages set, batch_exists counts the stored prefix,
  batch_get_v1 into other host pages is byte-exact and leaves every other
  page untouched, an unknown page is a miss;
- the MLA pool (page_first): the same;
- a hybrid model's Mamba pool (MambaPoolHost, page_first, shm) through the
  v2 interface: a state set at a prefix end with the KV pages, found with
  the trailing-pages policy (a prefix without its end state is not), and
  fetched into another slot byte-exact;
- an SWA window pool (a second MHATokenToKVPoolHost) through the v2
  calls: a two-page window set at the prefix end, found with the
  trailing-pages policy (a window with a page the pool lacks is not), and
  fetched into other pages byte-exact;
- TP 2: two spawned rank processes with torch.distributed (gloo), each its
  own pool with other bytes: a set of both ranks is visible and fetched
  byte-exact on each, a set only rank 0 sends never is;
- L2: the server restarted on its L2 directory, the same backend finds the
  pages and fetches them byte-exact (it re-registers by itself), for every
  pool below;
- the server killed: batch_exists answers 0 and batch_get_v1 all False
  within the backend's time-outs (lookup_timeout_ms, load_timeout_ms, then
  the wait for the job's end, store_wait_ms), nothing hangs;
- a pool anonymous to kvside (pin_memory tensors are not used by SGLang's
  allocators; a private tensor is) and a refused layout: clear errors;
- the interface: every method of the installed HiCacheStorage that SGLang
  calls is overridden with a signature SGLang's call sites fit (inspect),
  and mypy checks kvside/sglang/ against SGLang's own annotations (the
  overrides' types included);
- L2 after a restart and the server killed for every MHA layout and MLA
  with both allocators, and for the Mamba and SWA pools;
- SGLang's HiCacheController itself (ControllerTest): its backup, prefetch
  and prefetch I/O threads calling the backend, over SGLang's CPU device
  pool; L2 after a restart; the server killed between the hit query and the
  transfer. Substitutes there: the host pool unpinned (pinning calls CUDA)
  and the radix cache's part of a prefetch done by the test (SGLang's
  UnifiedRadixCache needs a running scheduler).

Environment: KVSIDE_LIB, KVS_SERVER; run by run.sh with the environment's
python (exit 77 when there is none: tests/sglang_pkg/run.sh).
"""

import inspect
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
SHIM = os.path.join(ROOT, "tests", "sglang", "shim")
# transformers caches its torchvision probe: asked while the stand-in is not
# on sys.path it answers False for good (see the header). A spawned rank
# process starts with its parent's sys.path, the stand-in on it: taken off
# for the probe.
sys.path[:] = [p for p in sys.path if p != SHIM]
from transformers.utils import import_utils as _tu  # noqa: E402
_tu.is_torchvision_available()
_tu.is_torchvision_v2_available()
for _p in (os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "worker", "python"), SHIM):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import sglang  # noqa: E402
from sglang.srt.mem_cache import hicache_storage as hs  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout, KVBuffers, MambaStateBufferInfo, MHABufferInfo, MLABufferInfo)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvt_server import Server  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 2, 2, 8, 4, 64
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
ALLOCATORS = ("shm", "default")


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout, allocator):
    """A host pool built the way SGLang's assembler builds it, from (CPU)
    device buffers of TOKENS + one padding page per layer."""
    k = [torch.zeros(TOKENS + PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(TOKENS + PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                allocator_type=allocator, device_capacity_tokens=TOKENS, start_layer=0,
                                end_layer=LAYERS)


def mla_pool(layout, allocator):
    lora, rope = 16, 8
    bufs = tuple(torch.zeros(TOKENS + PAGE, 1, lora + rope, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(LAYERS)),
                         device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=lora, qk_rope_head_dim=rope,
                         kv_cache_dim=lora + rope, dtype=torch.bfloat16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                allocator_type=allocator, device_capacity_tokens=TOKENS, start_layer=0,
                                end_layer=LAYERS, target_layer_num=LAYERS)


def storage_config(run, pool, allocator, mla=False, tp=(0, 1), **extra):
    """SGLang's storage config for the server at broker dir run; tp is
    (tp_rank, tp_size); extra goes into the extra config."""
    cfg = {"backend_name": "kvside", "module_path": "kvside.sglang", "class_name": "KvsideStorage",
           "interface_v1": 1, "allocator": allocator, "broker_dir": run}
    cfg.update(extra)
    return hs.HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1,
                                   is_mla_model=mla, enable_storage_metrics=False,
                                   is_page_first_layout=pool.layout != "layer_first", model_name="kvt-model",
                                   extra_config=cfg)


def attach(run, pool, allocator, mla=False, tp=(0, 1), side=None, **extra):
    """What SGLang's controllers do at attach: the factory, the anchor pool,
    for a hybrid model (side: {PoolName: host pool}) every pool of the group
    again through v2 (the anchor as KV), then the end of the registration
    burst."""
    be = StorageBackendFactory.create_backend("dynamic", storage_config(run, pool, allocator, mla, tp, **extra), pool)
    be.register_mem_pool_host(pool)
    if side:
        be.register_mem_host_pool_v2(pool, hs.PoolName.KV)
        for name, host_pool in side.items():
            be.register_mem_host_pool_v2(host_pool, name)
    be.on_host_pools_registered()
    return be


def fill_random(pool, seed):
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def pages(pool, indices):
    """The page starts of host indices (whole pages, as SGLang allocates)."""
    return [int(i) for i in indices[::pool.page_size]]


def page_bytes(pool, index):
    return pool.get_data_page(index).view(torch.uint8)


def differing_pages(pool, src, dst):
    """Positions i where page i of host indices src and of dst differ."""
    return [i for i, (p, q) in enumerate(zip(pages(pool, src), pages(pool, dst)))
            if not torch.equal(page_bytes(pool, p), page_bytes(pool, q))]


def tp_rank_main(rank, world, run, init_file, layout, out):
    """One TP rank of a TP 2 SGLang instance: torch.distributed (gloo) as
    SGLang initialises it before the hierarchical cache, its own host pool
    (its heads), the backend attached, then the storage calls. Each rank's
    pages hold other bytes (other heads). Puts (rank, result dict) on out."""
    import torch.distributed as dist
    res = {}
    try:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        pool = mha_pool(layout, "shm")
        fill_random(pool, 100 + rank)
        be = attach(run, pool, "shm", tp=(rank, world))
        src, dst = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
        keys = ["tp-page-0", "tp-page-1"]
        if rank == 0:
            # a set only rank 0 sends is never visible
            res["lone_set"] = be.batch_set_v1(["tp-lone"], pool.alloc(PAGE))
        dist.barrier()
        res["lone_exists"] = be.batch_exists(["tp-lone"])
        res["set"] = be.batch_set_v1(keys, src)
        res["exists"] = be.batch_exists(keys + ["tp-unknown"])
        res["get"] = be.batch_get_v1(keys, dst)
        res["exact"] = not differing_pages(pool, src, dst)
        be.close()
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported to the test, which fails on it
        import traceback
        res["error"] = "%s\n%s" % (e, traceback.format_exc())
    out.put((rank, res))


class PkgTest(unittest.TestCase):
    def setUp(self):
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.stop()

    def server(self, extra=(), **kw):
        s = Server("--allow-unsealed-memory", "true", *extra, **kw)
        s.start()
        self.servers.append(s)
        return s

    def roundtrip(self, pool, be, tag):
        """set 3 pages, exists, get them into 3 other pages: byte-exact, every
        other page untouched; an unknown fourth key is a miss."""
        extra = hs.HiCacheStorageExtraInfo()
        src = pool.alloc(3 * PAGE)
        dst = pool.alloc(3 * PAGE)
        self.assertIsNotNone(src)
        self.assertIsNotNone(dst)
        keys = ["%s-page-%d" % (tag, i) for i in range(3)]
        self.assertEqual(be.batch_set_v1(keys, src, extra), [True] * 3)
        self.assertEqual(be.batch_exists(keys + ["%s-unknown" % tag], extra), 3)
        self.assertEqual(be.batch_exists(["%s-unknown" % tag] + keys, extra), 0)
        # the destination pages hold other bytes before the get
        for p in pages(pool, dst):
            pool.get_data_page(p, flat=False).view(torch.uint8).fill_(0xEE)
        others = [p for p in range(0, pool.size, PAGE) if p not in pages(pool, dst)]
        before = {p: page_bytes(pool, p).clone() for p in others}
        self.assertEqual(be.batch_get_v1(keys, dst, extra), [True] * 3)
        # every page but the destinations (the sources too) is as before the get
        for p in others:
            self.assertTrue(torch.equal(page_bytes(pool, p), before[p]),
                            "%s: page %d changed by a get into other pages" % (tag, p // PAGE))
        self.assertEqual(differing_pages(pool, src, dst), [], "%s: pages differ after the get" % tag)
        return keys, src, dst

    def test_mha_layouts_and_allocators(self):
        srv = self.server()
        for layout in MHA_LAYOUTS:
            for allocator in ALLOCATORS:
                with self.subTest(layout=layout, allocator=allocator):
                    pool = mha_pool(layout, allocator)
                    fill_random(pool, hash((layout, allocator)) & 0xFFFF)
                    be = attach(srv.run, pool, allocator)
                    try:
                        self.roundtrip(pool, be, "%s-%s" % (layout, allocator))
                    finally:
                        be.close()

    def test_mla_pool(self):
        srv = self.server()
        for allocator in ALLOCATORS:
            with self.subTest(allocator=allocator):
                pool = mla_pool("page_first", allocator)
                fill_random(pool, 7)
                be = attach(srv.run, pool, allocator, mla=True)
                try:
                    self.roundtrip(pool, be, "mla-%s" % allocator)
                finally:
                    be.close()

    def every_pool(self, srv, **extra):
        """[(tag, pool, backend)] for every MHA layout and MLA, each with both
        allocators, attached to srv, each with its pages round-tripped."""
        out = []
        kinds = [(l, a, False) for l in MHA_LAYOUTS for a in ALLOCATORS] + [("page_first", a, True) for a in ALLOCATORS]
        for n, (layout, allocator, mla) in enumerate(kinds):
            pool = (mla_pool if mla else mha_pool)(layout, allocator)
            fill_random(pool, 300 + n)
            be = attach(srv.run, pool, allocator, mla=mla, **extra)
            self.addCleanup(be.close)
            tag = "%s-%s-%s" % ("mla" if mla else "mha", layout, allocator)
            keys, src, dst = self.roundtrip(pool, be, tag)
            out.append((tag, pool, be, keys, src, dst))
        return out

    def test_l2_after_restart(self):
        srv = self.server(l2=True, l2_sync="full")
        pools = self.every_pool(srv)
        srv.stop()
        srv.start()
        for tag, pool, be, keys, src, dst in pools:
            with self.subTest(pool=tag):
                for p in pages(pool, dst):
                    pool.get_data_page(p, flat=False).view(torch.uint8).fill_(0)
                deadline = time.monotonic() + 20
                while be.batch_exists(keys) != 3 and time.monotonic() < deadline:
                    time.sleep(0.1)  # the backend re-registers by itself
                self.assertEqual(be.batch_exists(keys), 3, "pages not found in L2 after the restart")
                self.assertEqual(be.batch_get_v1(keys, dst), [True] * 3)
                self.assertEqual(differing_pages(pool, src, dst), [], "pages differ after the restart")

    def test_server_killed(self):
        # a get that timed out waits for its job to end (up to store_wait_ms:
        # a live but slow server may still write into the pages); a killed
        # server cannot be told from a stopped one, so that wait runs out.
        # The deadlines are the documented pair, shortened: store_wait_ms
        # above the server's --job-deadline-ms. Every pool's calls at once
        # (threads, as SGLang's ranks and controllers would), then each
        # checked.
        import threading
        srv = self.server(extra=("--job-deadline-ms", "3000"))
        pools = self.every_pool(srv, timeout_ms=2000, lookup_timeout_ms=500, load_timeout_ms=2000,
                                store_wait_ms=4000)
        srv.kill()
        res = {}

        def calls(tag, be, keys, dst):
            res[tag] = (be.batch_exists(keys), be.batch_get_v1(keys, dst))
        t0 = time.monotonic()
        threads = [threading.Thread(target=calls, args=(tag, be, keys, dst)) for tag, _, be, keys, _, dst in pools]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertLess(time.monotonic() - t0, 20, "calls waited past their time-outs")
        for tag, *_ in pools:
            with self.subTest(pool=tag):
                self.assertEqual(res.get(tag), (0, [False] * 3))

    def test_tp2(self):
        import multiprocessing as mp
        import tempfile
        # the lone set waits for rank 1 until the server's job deadline
        srv = self.server(extra=("--job-deadline-ms", "3000"))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        init = os.path.join(tempfile.mkdtemp(prefix="kvt-sgl-tp-"), "init")
        procs = [ctx.Process(target=tp_rank_main, args=(r, 2, srv.run, init, "page_first", out)) for r in range(2)]
        for p in procs:
            p.start()
        import queue
        results, deadline = {}, time.monotonic() + 120
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                r, res = out.get(timeout=1)
                results[r] = res
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in results]
                self.assertFalse(dead, "rank(s) %s exited (%s) without a result" %
                                 (dead, [procs[i].exitcode for i in dead]))
        self.assertEqual(len(results), len(procs), "the ranks did not finish within 120 s")
        for p in procs:
            p.join(30)
        for r in range(2):
            res = results[r]
            self.assertNotIn("error", res, res.get("error"))
            self.assertEqual(res["lone_exists"], 0, "rank %d: a page only rank 0 stored is visible" % r)
            self.assertEqual(res["set"], [True, True])
            self.assertEqual(res["exists"], 2)
            self.assertEqual(res["get"], [True, True])
            self.assertTrue(res["exact"], "rank %d: its own heads differ after the get" % r)
        self.assertEqual(results[0]["lone_set"], [False])

    MODES = ("live", "l2", "killed")

    def mode_server(self, mode):
        """The server of a hybrid case: plain, with an L2 restarted after the
        sets, or killed after them (the documented time-out pair, shortened
        as in test_server_killed); (server, backend extra config)."""
        if mode == "l2":
            return self.server(l2=True, l2_sync="full"), {}
        if mode == "killed":
            return self.server(extra=("--job-deadline-ms", "3000")), dict(
                timeout_ms=2000, lookup_timeout_ms=500, load_timeout_ms=2000, store_wait_ms=4000)
        return self.server(), {}

    def upset(self, srv, be, mode, keys):
        """After the sets: restart (waiting until the backend finds the KV
        pages again) or kill."""
        if mode == "l2":
            srv.stop()
            srv.start()
            deadline = time.monotonic() + 20
            while be.batch_exists(keys) != len(keys) and time.monotonic() < deadline:
                time.sleep(0.1)
        elif mode == "killed":
            srv.kill()

    def test_hybrid_mamba(self):
        """A hybrid model's pools as SGLang registers them (the anchor, then
        every entry through v2) and its v2 calls: states set at a prefix end
        with the KV pages, batch_exists_v2 with the trailing-pages policy,
        the state fetched into another slot byte-exact (temporal and conv);
        again from L2 after a restart, and against a killed server (nothing
        found, nothing fetched, nothing hangs)."""
        for mode in self.MODES:
            with self.subTest(mode=mode):
                srv, extra = self.mode_server(mode)
                self.mamba_case(srv, mode, extra)

    def mamba_case(self, srv, mode, extra):
        pool = mha_pool("page_first", "shm")
        fill_random(pool, 17)
        layers, slots = 2, 8
        info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots + 1, 4, 8, dtype=torch.float32),
                                    conv=(torch.zeros(layers, slots + 1, 6, 3, dtype=torch.bfloat16),))
        mp = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                           allocator_type="shm", layout="page_first")
        mp.temporal_buffer.normal_()
        for c in mp.conv_buffer:
            c.normal_()
        be = attach(srv.run, pool, "shm", side={hs.PoolName.MAMBA: mp}, **extra)
        try:
            keys = ["hy-%s-%d" % (mode, i) for i in range(3)]
            kv_src, slot = pool.alloc(3 * PAGE), mp.alloc(1)
            trailing = hs.PoolHitPolicy.TRAILING_PAGES
            # a write-through: the side pools, then the KV pages
            set_t = hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=slot, keys=keys[-1:], hit_policy=trailing)
            self.assertEqual(list(be.batch_set_v2([set_t]).values()), [[True]])
            self.assertEqual(be.batch_set_v1(keys, kv_src), [True] * 3)
            self.upset(srv, be, mode, keys)
            t0 = time.monotonic()
            ok = mode != "killed"
            r = be.batch_exists_v2(keys, [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[-1:],
                                                          hit_policy=trailing)])
            self.assertEqual(r.kv_hit_pages, 3 if ok else 0)
            # no state at the end of two pages: nothing SGLang could restore
            r = be.batch_exists_v2(keys[:2], [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[1:2],
                                                              hit_policy=trailing)])
            self.assertEqual(r.kv_hit_pages, 0)
            kv_dst, slot2 = pool.alloc(3 * PAGE), mp.alloc(1)
            self.assertEqual(be.batch_get_v1(keys, kv_dst), [ok] * 3)
            get_t = hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=slot2, keys=keys[-1:], hit_policy=trailing)
            self.assertEqual(list(be.batch_get_v2([get_t]).values()), [[ok]])
            self.assertLess(time.monotonic() - t0, 30, "calls waited past their time-outs")
            if not ok:
                return
            a, b = int(slot[0]), int(slot2[0])
            self.assertNotEqual(a, b)
            self.assertTrue(torch.equal(mp.temporal_buffer[a], mp.temporal_buffer[b]), "temporal state differs")
            for c in mp.conv_buffer:
                self.assertTrue(torch.equal(c[a].view(torch.uint8), c[b].view(torch.uint8)), "conv state differs")
            self.assertEqual(differing_pages(pool, kv_src, kv_dst), [], "KV pages differ")
        finally:
            be.close()

    def test_hybrid_swa(self):
        """An SWA model's window pool (an MHATokenToKVPoolHost of its own,
        as SGLang's hybrid pool assembler builds it) through the v2 calls: a
        window of two pages set at the prefix end, batch_exists_v2 with the
        trailing-pages policy, the window fetched into other pages exact;
        again from L2 after a restart, and against a killed server."""
        for mode in self.MODES:
            with self.subTest(mode=mode):
                srv, extra = self.mode_server(mode)
                self.swa_case(srv, mode, extra)

    def swa_case(self, srv, mode, extra):
        pool, swa = mha_pool("page_first", "shm"), mha_pool("page_first", "shm")
        fill_random(pool, 19)
        fill_random(swa, 23)
        be = attach(srv.run, pool, "shm", side={hs.PoolName.SWA: swa}, **extra)
        try:
            trailing = hs.PoolHitPolicy.TRAILING_PAGES
            keys = ["sw-%s-%d" % (mode, i) for i in range(4)]
            kv_src, win_src = pool.alloc(4 * PAGE), swa.alloc(2 * PAGE)
            set_t = hs.PoolTransfer(name=hs.PoolName.SWA, host_indices=win_src, keys=keys[-2:], hit_policy=trailing)
            self.assertEqual(list(be.batch_set_v2([set_t]).values()), [[True, True]])
            self.assertEqual(be.batch_set_v1(keys, kv_src), [True] * 4)
            self.upset(srv, be, mode, keys)
            t0 = time.monotonic()
            ok = mode != "killed"
            ask = [hs.PoolTransfer(name=hs.PoolName.SWA, keys=keys[-2:], hit_policy=trailing)]
            self.assertEqual(be.batch_exists_v2(keys, ask).kv_hit_pages, 4 if ok else 0)
            # the window ending at page 3 holds page 1, which the SWA pool lacks
            ask = [hs.PoolTransfer(name=hs.PoolName.SWA, keys=keys[1:3], hit_policy=trailing)]
            self.assertEqual(be.batch_exists_v2(keys[:3], ask).kv_hit_pages, 0)
            win_dst = swa.alloc(2 * PAGE)
            get_t = hs.PoolTransfer(name=hs.PoolName.SWA, host_indices=win_dst, keys=keys[-2:], hit_policy=trailing)
            self.assertEqual(list(be.batch_get_v2([get_t]).values()), [[ok, ok]])
            self.assertLess(time.monotonic() - t0, 30, "calls waited past their time-outs")
            if ok:
                self.assertEqual(differing_pages(swa, win_src, win_dst), [], "window pages differ")
        finally:
            be.close()

    def test_refusals(self):
        srv = self.server()
        pool = mha_pool("layer_first", "default")
        cfg = storage_config(srv.run, pool, "default")
        cfg.extra_config = dict(cfg.extra_config, no_such_key=1)
        with self.assertRaisesRegex(ValueError, "no_such_key"):
            StorageBackendFactory.create_backend("dynamic", cfg, pool)
        cfg = storage_config(srv.run, pool, "default")
        del cfg.extra_config["interface_v1"]
        with self.assertRaisesRegex(ValueError, "interface_v1"):
            StorageBackendFactory.create_backend("dynamic", cfg, pool)
        # a pool whose buffer is private anonymous memory: refused, naming why
        be = StorageBackendFactory.create_backend("dynamic", storage_config(srv.run, pool, "default"), pool)
        try:
            pool.kv_buffer = torch.zeros_like(pool.kv_buffer)
            with self.assertRaisesRegex(Exception, "anonymous|memfd|allocator"):
                be.register_mem_pool_host(pool)
        finally:
            be.close()

    def test_types_check_against_this_sglang(self):
        """mypy on kvside/sglang/ with SGLang's own annotations (SGLang ships
        no py.typed: --follow-untyped-imports reads them; without it every
        SGLang type would be Any and no override would be checked)."""
        import subprocess
        r = subprocess.run([sys.executable, "-m", "mypy", "--python-version", "3.11", "--follow-imports=silent",
                            "--follow-untyped-imports", "--ignore-missing-imports", "--check-untyped-defs",
                            "--cache-dir=/dev/null", "kvside/sglang/"],
                           cwd=os.path.join(ROOT, "worker", "python"), capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_interface(self):
        from kvside.sglang import KvsideStorage
        base = hs.HiCacheStorage
        called = ["register_mem_pool_host", "register_mem_host_pool_v2", "on_host_pools_registered",
                  "batch_exists", "batch_get_v1", "batch_set_v1", "batch_exists_v2", "batch_get_v2",
                  "batch_set_v2", "exists", "get", "set", "batch_get", "batch_set", "clear", "get_stats"]
        for name in called:
            with self.subTest(method=name):
                self.assertTrue(hasattr(base, name), "SGLang's HiCacheStorage has no %s any more" % name)
                want = [p for p in inspect.signature(getattr(base, name)).parameters.values()]
                have = inspect.signature(getattr(KvsideStorage, name)).parameters
                for p in want:
                    self.assertIn(p.name, have, "%s lacks parameter %s of SGLang's %s" % (name, p.name, name))
                    if p.default is not inspect.Parameter.empty:
                        self.assertIsNot(have[p.name].default, inspect.Parameter.empty,
                                         "%s.%s must stay optional as in SGLang" % (name, p.name))
                self.assertEqual(len(have), len(want), "%s takes other parameters than SGLang's" % name)
        for name in [n for n, v in vars(base).items() if callable(v) and getattr(v, "__isabstractmethod__", False)]:
            self.assertIn(name, vars(KvsideStorage), "abstract %s not overridden" % name)


class ControllerTest(unittest.TestCase):
    """SGLang's own HiCacheController drives the backend: attached through
    its attach_storage_backend ("dynamic", the README's extra config), its
    backup thread calls batch_set_v1 for write_storage, its prefetch thread
    batch_exists with the page hashes SGLang computes (get_storage_hash_str),
    its prefetch I/O thread batch_get_v1, and its sync thread acknowledges.
    The device pool is SGLang's MHATokenToKVPool on the CPU with its paged
    allocator, the host pool built from its buffer info. Substitutes: the
    host pool is not pinned (pin_memory=False: pinning calls CUDA), and the
    test does the radix cache's part of a prefetch (drain the hit queue,
    allocate host pages for the hit, queue the transfer): SGLang's
    UnifiedRadixCache needs a running scheduler."""

    @classmethod
    def setUpClass(cls):
        import tempfile
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_context, get_parallel
        cls.args = get_context().override_server_args(device="cpu", page_size=PAGE)
        cls.args.install()
        get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_dcp_rank=0)
        cls.tmp = tempfile.mkdtemp(prefix="kvt-sgl-cc-")
        dist.init_process_group("gloo", init_method="file://" + os.path.join(cls.tmp, "init"), rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel
        dist.destroy_process_group()
        get_parallel().clear_stamp()
        cls.args.restore()

    def setUp(self):
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.stop()

    def controller(self, srv, **extra):
        import threading
        import torch.distributed as dist
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        dev = MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
        alloc = PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", dev, False)
        host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, "page_first", pin_memory=False,
                                    device="cpu", allocator_type="shm", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=LAYERS)
        cfg = {"backend_name": "kvside", "module_path": "kvside.sglang", "class_name": "KvsideStorage",
               "interface_v1": 1, "allocator": "shm", "broker_dir": srv.run}
        cfg.update(extra)
        cc = HiCacheController(alloc, host, PAGE, dist.group.WORLD, threading.Event(), storage_backend="dynamic",
                               storage_backend_extra_config=cfg, model_name="kvt-model", prefetch_threshold=PAGE,
                               io_backend="direct")
        self.addCleanup(cc.detach_storage_backend)
        self.assertEqual(cc.page_set_func.__name__, "_page_set_zero_copy")  # interface_v1 taken
        fill_random(host, 21)
        return cc, host

    def backup(self, cc, host, tokens):
        """write_storage of len(tokens) host tokens; (host indices, tokens the backup thread stored)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        idx = host.alloc(len(tokens))
        cc.write_storage(idx, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
        return idx, cc.ack_backup_queue.get(timeout=60).completed_tokens

    def prefetch(self, cc, host, rid, tokens, between=None):
        """A prefetch through the controller's threads; the radix cache's part
        done here. between() runs after the hit query, before the transfer.
        (hit tokens, host indices or None, tokens fetched)."""
        cc.prefetch(rid, tokens)
        hit = cc.prefetch_hit_queue.get(timeout=60)
        self.assertIs(hit.request_id, rid)
        if hit.storage_hit_count == 0:
            return 0, None, 0
        if between:
            between()
        dst = cc.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        for p in pages(host, dst):
            host.get_data_page(p, flat=False).view(torch.uint8).fill_(0xEE)
        hit.host_indices = dst
        cc.prefetch_buffer.put(hit)
        got = 0
        while True:  # the acks carry the rank-agreed progress (the radix cache copies it)
            ack = cc.ack_prefetch_queue.get(timeout=60)
            if ack.completed_tokens is not None:
                got = ack.completed_tokens
            if ack.completed_req:
                return hit.storage_hit_count, dst, got

    def test_backup_and_prefetch(self):
        srv = Server("--allow-unsealed-memory", "true", l2=True, l2_sync="full")
        srv.start()
        self.servers.append(srv)
        cc, host = self.controller(srv)
        tokens = list(range(5000, 5000 + 4 * PAGE))
        src, stored = self.backup(cc, host, tokens)
        self.assertEqual(stored, 4 * PAGE)
        hit, dst, got = self.prefetch(cc, host, "rid-1", tokens + [1, 2, 3, 4, 5, 6, 7, 8])
        self.assertEqual((hit, got), (4 * PAGE, 4 * PAGE))  # the stored prefix, not the unknown tail
        self.assertEqual(differing_pages(host, src, dst), [], "prefetched pages differ")
        self.assertEqual(self.prefetch(cc, host, "rid-2", [9] * (2 * PAGE))[0], 0)  # never stored: a miss
        # the server restarted on its L2: the controller finds and fetches the pages again
        srv.stop()
        srv.start()
        deadline = time.monotonic() + 30
        while True:
            hit, dst, got = self.prefetch(cc, host, "rid-3", tokens)
            if hit or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual((hit, got), (4 * PAGE, 4 * PAGE), "not found through L2 after the restart")
        self.assertEqual(differing_pages(host, src, dst), [], "pages differ after the restart")

    def test_server_killed_mid_prefetch(self):
        # the documented pair, shortened as in PkgTest.test_server_killed
        srv = Server("--allow-unsealed-memory", "true", "--job-deadline-ms", "3000")
        srv.start()
        self.servers.append(srv)
        cc, host = self.controller(srv, timeout_ms=2000, lookup_timeout_ms=500, load_timeout_ms=2000,
                                   store_wait_ms=4000)
        tokens = list(range(7000, 7000 + 3 * PAGE))
        self.assertEqual(self.backup(cc, host, tokens)[1], 3 * PAGE)
        t0 = time.monotonic()
        # killed between the hit query and the transfer: the transfer gets
        # nothing, the controller acknowledges, nothing hangs
        hit, dst, got = self.prefetch(cc, host, "rid-k", tokens, between=srv.kill)
        self.assertEqual((hit, got), (3 * PAGE, 0))
        # and a prefetch against the dead server: a miss
        self.assertEqual(self.prefetch(cc, host, "rid-k2", tokens)[0], 0)
        self.assertLess(time.monotonic() - t0, 30, "the controller's calls waited past their time-outs")
        # a new server on the same directory: backups and prefetches work again
        srv.start()
        deadline = time.monotonic() + 30
        while self.backup(cc, host, tokens)[1] != 3 * PAGE and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(self.prefetch(cc, host, "rid-k3", tokens)[2], 3 * PAGE)


if __name__ == "__main__":
    print("sglang", sglang.__version__, "torch", torch.__version__)
    unittest.main(verbosity=2)
