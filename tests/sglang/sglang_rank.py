"""One SGLang TP rank for tests/sglang/test_backend.py: a process holding
host KV pools (and hybrid models' pool groups, HybridSet) (the stand-in MHATokenToKVPoolHost / MLATokenToKVPoolHost in
SGLang's layouts and allocators), one HiCacheController per pool with
kvside.sglang.KvsideStorage attached through SGLang's dynamic backend
factory, and torch.distributed (gloo) as SGLang's TP group, so the hit counts
and acks are reduced across ranks as SGLang does. It runs the phases the test
sends over a pipe and answers with what it saw; every page it fetches is
compared byte for byte with what the storing rank wrote, and every other page
of the pool must be untouched.
"""

import hashlib
import time
import traceback

import torch

PAGE = 4

# name, MLA?, layout, allocator ("shm": SGLang's memfd; "default": its shared anonymous mapping)
SPECS = [("mha-lf", False, "layer_first", "shm"),
         ("mha-pf", False, "page_first", "shm"),
         ("mha-pfd", False, "page_first_direct", "default"),
         ("mla-pf", True, "page_first", "shm")]


def tokens(seed, n_pages, base=None):
    out = list(base or [])
    x = seed * 7919 + 17
    while len(out) < n_pages * PAGE:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x % 50000)
    return out[:n_pages * PAGE]


class Pool:
    def __init__(self, spec, rank, world, extra):
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
        self.name, self.mla, layout, allocator = spec
        self.rank = rank
        size = 600 * PAGE
        if self.mla:
            self.pool = MLATokenToKVPoolHost(size, PAGE, layout, torch.float16, layer_num=3, kv_cache_dim=24,
                                             allocator_type=allocator)
        else:
            self.pool = MHATokenToKVPoolHost(size, PAGE, layout, torch.float16, layer_num=3, head_num=2,
                                             head_dim=8, allocator_type=allocator)
        cfg = dict(extra, allocator=allocator)
        self.ctl = HiCacheController(self.pool, PAGE, torch.distributed.group.WORLD, tp_rank=rank, tp_size=world,
                                     is_mla_model=self.mla, storage_backend="dynamic", model_name="test/tiny-model",
                                     storage_backend_extra_config=cfg)
        self.backend = self.ctl.storage_backend

    # -- page contents

    def expected(self, page_hash, shape):
        """What the storing rank wrote for this page: rank-specific for MHA
        (each rank holds other heads), the same on every rank for MLA."""
        owner = 0 if self.mla else self.rank
        seed = int(hashlib.blake2b(("%s|%d|%s" % (self.name, owner, page_hash)).encode(),
                                   digest_size=7).hexdigest(), 16)
        g = torch.Generator().manual_seed(seed)
        n = 1
        for d in shape:
            n *= d
        return torch.randint(-32768, 32767, (n,), generator=g, dtype=torch.int16).reshape(shape)

    def page(self, index, buf=None):
        if buf is not None:
            saved, self.pool.kv_buffer = self.pool.kv_buffer, buf
        try:
            return self.pool.get_data_page(index, flat=False)
        finally:
            if buf is not None:
                self.pool.kv_buffer = saved

    def fill(self, host_indices, hashes):
        for i, h in enumerate(hashes):
            v = self.page(int(host_indices[i * PAGE]))
            v.copy_(self.expected(h, v.shape).view(v.dtype))

    # -- phases

    def store(self, toks):
        from sglang.srt.mem_cache.utils import get_hash_str
        hashes = get_hash_str(toks, None, page_size=PAGE)
        host = self.pool.alloc(len(hashes) * PAGE)
        assert host is not None, "host pool full"
        self.fill(host, hashes)
        op = self.ctl.write_storage(host, toks, hash_value=hashes)
        self.ctl.run_backup(op)
        self.pool.free(host)
        return op.completed_tokens

    def fetch(self, toks):
        """SGLang's prefetch: hit query (reduced), host pages for the hit,
        transfer (acks reduced); then every fetched page is checked and every
        other page of the pool must be unchanged."""
        op = self.ctl.prefetch("req", toks)
        self.ctl.run_prefetch_query(op)
        hit = op.storage_hit_count
        out = {"hit": hit, "done": 0, "bad_pages": [], "touched_pages": []}
        if hit == 0:
            return out
        host = self.pool.alloc(hit)
        assert host is not None, "host pool full"
        op.host_indices = host
        for i in range(hit // PAGE):  # poison: a page nobody writes cannot pass for a fetched one
            v = self.page(int(host[i * PAGE]))
            v.copy_(torch.full(v.shape, 0x5A5A, dtype=torch.int16).view(v.dtype))
        snapshot = self.pool.kv_buffer.clone()
        self.ctl._page_transfer(op)
        out["done"] = op.completed_tokens
        targets = {}
        for i, h in enumerate(op.hash_value[: op.completed_tokens // PAGE]):
            targets[int(host[i * PAGE]) // PAGE] = h
        for p in range(self.pool.size // PAGE):
            cur = self.page(p * PAGE)
            if p in targets:
                if not torch.equal(cur.contiguous().view(torch.int16), self.expected(targets[p], cur.shape)):
                    out["bad_pages"].append(p)
            elif not torch.equal(cur.contiguous().view(torch.int16),
                                 self.page(p * PAGE, snapshot).contiguous().view(torch.int16)):
                out["touched_pages"].append(p)
        self.pool.free(host)
        return out

    def exists(self, toks):
        from sglang.srt.mem_cache.utils import get_hash_str
        return self.backend.batch_exists(get_hash_str(toks, None, page_size=PAGE))


# ---- hybrid models (SGLang's HybridCacheController and the v2 storage interface) ----------

# name, MLA (rank-replicated KV)?, side pools: Mamba states (TP-sharded) plus an
# SWA pool (MHA: trailing window of SWA_WINDOW pages) or a KV-derived indexer
# pool (MLA, DSA-style: same page indices as the KV pool, all pages)
HYBRID_SPECS = [("hyb-mha", False), ("hyb-mla", True)]
SWA_WINDOW = 2


def page_views(pool, page, bufs=None):
    """The tensors holding host page `page` of an SGLang host pool (a Mamba
    slot: its temporal and conv states), optionally in copies of its buffers."""
    from sglang.srt.mem_cache.pool_host import MambaPoolHost
    if isinstance(pool, MambaPoolHost):
        temporal, conv = bufs if bufs is not None else (pool.temporal_buffer, pool.conv_buffer)
        return [temporal[page]] + [c[page] for c in conv]
    if bufs is not None:
        saved, pool.kv_buffer = pool.kv_buffer, bufs
    try:
        return [pool.get_data_page(page * pool.page_size, flat=False)]
    finally:
        if bufs is not None:
            pool.kv_buffer = saved


def snapshot(pool):
    from sglang.srt.mem_cache.pool_host import MambaPoolHost
    if isinstance(pool, MambaPoolHost):
        return (pool.temporal_buffer.clone(), [c.clone() for c in pool.conv_buffer])
    return pool.kv_buffer.clone()


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


class HybridSet:
    """One hybrid model on this rank: a HostPoolGroup (KV anchor + side
    pools) behind a HybridCacheController with the backend attached; the test
    plays SGLang's radix cache (which pages, slots and keys each transfer
    names)."""

    def __init__(self, spec, rank, world, extra):
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.pool_host import (HostPoolGroup, MambaPoolHost, MHATokenToKVPoolHost,
                                                    MLATokenToKVPoolHost, PoolEntry)
        self.name, self.mla = spec
        self.rank = rank
        size = 64 * PAGE
        if self.mla:
            kv = MLATokenToKVPoolHost(size, PAGE, "layer_first", torch.float16, layer_num=2, kv_cache_dim=16,
                                      allocator_type="shm")
            mamba = MambaPoolHost(3, [(4, 6), (2, 5)], (2, 4, 3), torch.float16, torch.float32, host_size=12,
                                  allocator_type="default", layout="page_first_direct")
            side = MLATokenToKVPoolHost(size, PAGE, "page_first", torch.uint8, layer_num=2, kv_cache_dim=8,
                                        allocator_type="shm")
            self.side_name = PoolName.INDEXER
        else:
            kv = MHATokenToKVPoolHost(size, PAGE, "page_first", torch.float16, layer_num=2, head_num=2,
                                      head_dim=8, allocator_type="shm")
            mamba = MambaPoolHost(2, [(3, 8)], (2, 2, 4), torch.bfloat16, torch.float32, host_size=12,
                                  allocator_type="shm", layout="page_first")
            side = MHATokenToKVPoolHost(24 * PAGE, PAGE, "page_first_direct", torch.float16, layer_num=1,
                                        head_num=2, head_dim=4, allocator_type="default")
            self.side_name = PoolName.SWA
        self.pools = {PoolName.KV: kv, PoolName.MAMBA: mamba, self.side_name: side}
        entries = [PoolEntry(PoolName.KV, kv, None, None, is_primary_index_anchor=True),
                   PoolEntry(PoolName.MAMBA, mamba, None, None),
                   PoolEntry(self.side_name, side, None, None)]
        self.group = HostPoolGroup(entries)
        cfg = dict(extra, allocator="shm")
        self.ctl = HybridCacheController(self.group, PAGE, torch.distributed.group.WORLD, tp_rank=rank,
                                         tp_size=world, is_mla_model=self.mla, storage_backend="dynamic",
                                         model_name="test/tiny-hybrid", storage_backend_extra_config=cfg)
        self.backend = self.ctl.storage_backend

    # -- page contents

    def owner(self, pool_name):
        from sglang.srt.mem_cache.hicache_storage import PoolName
        # MLA KV and its KV-derived indexer are the same on every rank (TP
        # rank 0 stores them); Mamba states are TP-sharded in every model
        return 0 if self.mla and pool_name != PoolName.MAMBA else self.rank

    def expected(self, pool_name, i, page_hash, t):
        """What the storing rank wrote into view i of a page: bytes in the
        view's dense (contiguous) order."""
        seed = int(hashlib.blake2b(("%s|%s/%d|%d|%s" % (self.name, pool_name, i, self.owner(pool_name),
                                                        page_hash)).encode(), digest_size=7).hexdigest(), 16)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g,
                             dtype=torch.int64).to(torch.uint8)

    def fill(self, pool_name, page, page_hash):
        pool = self.pools[pool_name]
        for i, t in enumerate(page_views(pool, page)):  # views may be strided (K and V planes)
            t.copy_(self.expected(pool_name, i, page_hash, t).view(t.dtype).reshape(t.shape))

    def check(self, pool_name, page, page_hash):
        pool = self.pools[pool_name]
        return all(torch.equal(as_bytes(t).reshape(-1), self.expected(pool_name, i, page_hash, t))
                   for i, t in enumerate(page_views(pool, page)))

    # -- phases

    def transfers(self, stored):
        """The side-pool transfers SGLang's tree hands to write_storage for
        the node of these pages: Mamba states at the page ends in `states`,
        SWA pages `swa` (MHA) or the indexer pages of the node (MLA)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        out, slots = [], []
        mamba = self.pools[PoolName.MAMBA]
        if stored["states"]:
            idx = mamba.alloc(len(stored["states"]))
            for slot, h in zip(idx.tolist(), stored["states"]):
                self.fill(PoolName.MAMBA, slot, h)
            out.append(PoolTransfer(name=PoolName.MAMBA, host_indices=idx, keys=list(stored["states"]),
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
            slots.append((PoolName.MAMBA, idx))
        if self.side_name == PoolName.SWA and stored.get("swa"):
            swa = self.pools[PoolName.SWA]
            idx = swa.alloc(len(stored["swa"]) * PAGE)
            for i, h in enumerate(stored["swa"]):
                self.fill(PoolName.SWA, int(idx[i * PAGE]) // PAGE, h)
            out.append(PoolTransfer(name=PoolName.SWA, host_indices=idx, keys=list(stored["swa"]),
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
            slots.append((PoolName.SWA, idx))
        if self.side_name == PoolName.INDEXER:
            out.append(PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV))
        return out, slots

    def store(self, op):
        """One write-through of a node: KV pages hashes[lo:hi] of the prompt,
        with the side-pool content `op` names."""
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.utils import get_hash_str
        hashes = get_hash_str(op["tokens"], None, page_size=PAGE)
        lo, hi = op["pages"]
        node = hashes[lo:hi]
        stored = {"states": [hashes[i - 1] for i in op["states"]],
                  "swa": [hashes[i] for i in op.get("swa", [])]}
        host = self.pools[PoolName.KV].alloc(len(node) * PAGE)
        for i, h in enumerate(node):
            self.fill(PoolName.KV, int(host[i * PAGE]) // PAGE, h)
            if self.side_name == PoolName.INDEXER:
                self.fill(PoolName.INDEXER, int(host[i * PAGE]) // PAGE, h)
        extra, slots = self.transfers(stored)
        sop = self.ctl.write_storage(host, op["tokens"][lo * PAGE:hi * PAGE], hash_value=node,
                                     extra_pools=extra)
        self.ctl.run_backup(sop)
        self.pools[PoolName.KV].free(host)
        for name, idx in slots:
            self.pools[name].free(idx)
        return {"done": sop.completed_tokens,
                "pools": {str(k): v for k, v in sop.pool_storage_result.extra_pool_hit_pages.items()}}

    def fetch(self, toks):
        """SGLang's hybrid prefetch: hit query (batch_exists_v2 with the side
        pools' transfers), KV and KV-derived pages batch by batch, then the
        trailing side pools; every fetched page checked byte for byte, every
        other page of every pool unchanged."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_hash_str
        hashes = get_hash_str(toks, None, page_size=PAGE)
        mamba, side = self.pools[PoolName.MAMBA], self.pools[self.side_name]
        extra = [PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(1), keys=hashes[-1:],
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        if self.side_name == PoolName.SWA:
            extra.append(PoolTransfer(name=PoolName.SWA, host_indices=side.alloc(SWA_WINDOW * PAGE),
                                      keys=hashes[-SWA_WINDOW:], hit_policy=PoolHitPolicy.TRAILING_PAGES))
        else:
            extra.append(PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV))
        owned = [(t.name, t.host_indices) for t in extra if t.host_indices is not None]
        op = self.ctl.prefetch("req", toks, extra_pools=extra)
        self.ctl.run_prefetch_query(op)
        hit = op.storage_hit_count
        out = {"hit": hit, "done": 0, "bad": [], "touched": [], "pool_hits": {}}
        if hit:
            kv = self.pools[PoolName.KV]
            host = kv.alloc(hit)
            op.host_indices = host
            targets = {name: {} for name in self.pools}
            for name, pool in self.pools.items():  # poison the pages SGLang hands over
                idx = host if name in (PoolName.KV, PoolName.INDEXER) else dict(owned).get(name)
                if idx is None:
                    continue
                for i in range(0, len(idx), pool.page_size):
                    for t in page_views(pool, int(idx[i]) // pool.page_size):
                        t.copy_(torch.full((t.numel() * t.element_size(),), 0x5A, dtype=torch.uint8)
                                .view(t.dtype).reshape(t.shape))
            snaps = {name: snapshot(pool) for name, pool in self.pools.items()}
            self.ctl._page_transfer(op)
            done = op.completed_tokens // PAGE
            out["done"] = op.completed_tokens
            out["pool_hits"] = {k: v for k, v in (op.pool_hits or {}).items() if v}
            for i, h in enumerate(op.hash_value[:done]):
                targets[PoolName.KV][int(host[i * PAGE]) // PAGE] = h
                if self.side_name == PoolName.INDEXER:
                    targets[PoolName.INDEXER][int(host[i * PAGE]) // PAGE] = h
            for t in extra:
                if t.indices_from_pool is not None:
                    continue
                got = (op.pool_hits or {}).get(str(t.name), 0)
                pool = self.pools[t.name]
                for i, h in enumerate((t.keys or [])[:got]):
                    targets[t.name][int(t.host_indices[i * pool.page_size]) // pool.page_size] = h
            for name, pool in self.pools.items():
                for p in range(pool.size // pool.page_size):
                    if p in targets[name]:
                        if not self.check(name, p, targets[name][p]):
                            out["bad"].append("%s:%d" % (name, p))
                    elif not all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in
                                 zip(page_views(pool, p), page_views(pool, p, snaps[name]))):
                        out["touched"].append("%s:%d" % (name, p))
            kv.free(host)
        for name, idx in owned:
            self.pools[name].free(idx)
        return out


def main(rank, world, conn, init_file, extra):
    import logging
    logging.basicConfig(level=logging.WARNING, format="rank%d %%(name)s: %%(message)s" % rank)
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    pools = {}
    hybrids = {}

    def on_each(fn):
        return {name: fn(p) for name, p in pools.items()}

    def on_hybrids(fn):
        return {name: fn(h) for name, h in hybrids.items()}

    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "quit":
                for p in list(pools.values()) + list(hybrids.values()):
                    p.backend.close()
                conn.send(("ok", None))
                break
            if cmd == "attach":
                for spec in SPECS:
                    pools[spec[0]] = Pool(spec, rank, world, extra)
                res = on_each(lambda p: {"ns": p.backend.namespace, "engine": p.backend.engine,
                                         "world": p.backend.world})
            elif cmd == "store":
                res = on_each(lambda p: [p.store(t) for t in arg])
            elif cmd == "fetch":
                res = on_each(lambda p: [p.fetch(t) for t in arg])
            elif cmd == "exists":
                res = on_each(lambda p: [p.exists(t) for t in arg])
            elif cmd == "solo_store":
                # only rank 0 backs these pages up: its job must not commit
                p = pools[arg["pool"]]
                res = {"rank": rank}
                if rank == 0:
                    t0 = time.monotonic()
                    res["done"] = p.store(arg["tokens"])
                    res["s"] = time.monotonic() - t0
            elif cmd == "wait_reconnect":
                deadline = time.monotonic() + arg
                while time.monotonic() < deadline and any(
                        p.backend.stats["reconnects"] < 1 for p in pools.values()):
                    time.sleep(0.05)
                res = on_each(lambda p: p.backend.stats["reconnects"])
            elif cmd == "hybrid_attach":
                for spec in HYBRID_SPECS:
                    hybrids[spec[0]] = HybridSet(spec, rank, world, extra)
                res = on_hybrids(lambda h: {name: {"ns": r.namespace, "engine": r.engine, "world": r.world,
                                                   "kind": r.kind}
                                            for name, r in h.backend.regs.items()})
            elif cmd == "hybrid_store":
                res = on_hybrids(lambda h: [h.store(op) for op in arg])
            elif cmd == "hybrid_fetch":
                res = on_hybrids(lambda h: [h.fetch(t) for t in arg])
            elif cmd == "hybrid_wait_reconnect":
                deadline = time.monotonic() + arg
                while time.monotonic() < deadline and any(
                        r.reconnects < 1 for h in hybrids.values() for r in h.backend.regs.values()):
                    time.sleep(0.05)
                res = on_hybrids(lambda h: {n: r.reconnects for n, r in h.backend.regs.items()})
            elif cmd == "stats":
                res = on_each(lambda p: dict(p.backend.stats))
            else:
                raise ValueError(cmd)
            conn.send(("ok", res))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    torch.distributed.destroy_process_group()
