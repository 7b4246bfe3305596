"""kvside.sglang: an L3 storage backend for SGLang's hierarchical cache
(HiCache), loaded through SGLang's ``dynamic`` storage backend (docs/sglang.md).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvside",
        "module_path": "kvside.sglang", "class_name": "KvsideStorage",
        "interface_v1": 1, "allocator": "shm", "broker_dir": "/run/kvside"}'

Written against sgl-project/sglang at 001067fffe33427bee0ed2f007fb7551a1d76b44
(hicache_storage.py, storage/backend_factory.py, managers/cache_controller.py;
the host pools and allocators at the commits tests/sglang/stub cites).
Importing this module needs SGLang (the HiCacheStorage base class).

How it maps (each decision is explained in docs/sglang.md):
- one kvside chunk = one SGLang page; its key is SGLang's page hash (which
  already chains the whole prefix) hashed with the namespace;
- the rank's host pool is registered ONCE (every page of every layer, K and
  V, as kvside layer views derived from ``get_page_buffer_meta``), so gets and
  sets are zero-copy between the pool and the server;
- TP ranks are kvside ranks (world = TP size) for MHA pools: a page set is
  one kvside job spanning all TP ranks, committed only when every rank's part
  is in; MLA pools are identical on every rank, so each rank is a world of
  one and only TP rank 0 stores (SGLang's own rule);
- job ids are derived, not exchanged: every rank computes the same id from
  the engine name (agreed once through torch.distributed), the operation, the
  keys and a per-key-list occurrence counter.
"""

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields

import kvside
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

log = logging.getLogger("kvside.sglang")

__all__ = ["KvsideStorage", "StorageConfig", "namespace_of", "page_key", "pool_views"]


from kvside import layout as _layout  # noqa: E402  (engine-neutral views and host memory)

LayoutError = _layout.LayoutError

# keys SGLang itself reads from --hicache-storage-backend-extra-config
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size")
MAX_KEYS = 4096          # protocol.md 2.3: keys per request
_LRU = 65536             # occurrence counters kept (as many as the server's terminal table)


# ---- configuration ------------------------------------------------------------------------

@dataclass
class StorageConfig:
    broker_dir: str = None          # kvside-server's fd-broker directory (None: its default)
    endpoint: str = None            # ZeroMQ endpoint (None: ipc://<broker_dir>/kvside.zmq)
    namespace: str = None           # the whole namespace (None: derived, see namespace_of)
    namespace_salt: str = ""        # mixed into the derived namespace (tenant isolation)
    timeout_ms: int = 10000         # default request timeout (also opening the session)
    lookup_timeout_ms: int = 2000   # batch_exists; a late answer counts as no hit
    load_timeout_ms: int = 30000    # batch_get_v1: one retrieve
    store_wait_ms: int = 65000      # batch_set_v1: longest wait for the job to end on all ranks
    pin_ms: int = 10000             # a hit stays pinned in L1 this long (until its get)
    prefetch: bool = True           # batch_exists starts promoting L2 hits into L1

    @classmethod
    def from_extra(cls, extra):
        extra = dict(extra or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                "kvside: SGLang must call the zero-copy interface (batch_get_v1/batch_set_v1): add "
                "\"interface_v1\": 1 to --hicache-storage-backend-extra-config")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known) - set(SGLANG_KEYS))
        if unknown:
            raise ValueError("kvside: unknown --hicache-storage-backend-extra-config key(s) %s; kvside's "
                             "keys: %s; SGLang's: %s" % (", ".join(unknown), ", ".join(sorted(known)),
                                                         ", ".join(SGLANG_KEYS)))
        cfg = cls()
        for k, v in extra.items():
            if k not in known:
                continue
            default = known[k].default
            if isinstance(default, bool):
                if not isinstance(v, bool):
                    raise ValueError("kvside: %s must be true or false, not %r" % (k, v))
            elif isinstance(default, int):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError("kvside: %s must be a non-negative integer, not %r" % (k, v))
            elif v is not None and not isinstance(v, str):
                raise ValueError("kvside: %s must be a string, not %r" % (k, v))
            setattr(cfg, k, v)
        for k in ("timeout_ms", "lookup_timeout_ms", "load_timeout_ms", "store_wait_ms"):
            if getattr(cfg, k) <= 0:
                raise ValueError("kvside: %s must be positive" % k)
        if cfg.pin_ms > 600000:
            raise ValueError("kvside: pin_ms must be at most 600000")
        if cfg.namespace is not None and not 0 < len(cfg.namespace.encode()) <= 128:
            raise ValueError("kvside: namespace must be 1..128 bytes")
        return cfg


# ---- the host pool as kvside views ------------------------------------------------------

def pool_views(pool):
    """(views, num_pages): the kvside layer views of an SGLang host pool, one
    per (pointer) entry that ``get_page_buffer_meta`` returns for a page (K and
    V of every layer for layer_first MHA; K and V page slabs for page_first,
    page_first_direct and page_head; one slab or one per layer for MLA). Block
    p of view j is page p. The views are checked to be linear in the page
    index over the whole pool, so the bytes kvside moves for a page are
    exactly the bytes SGLang's zero-copy backends move for it."""
    import torch
    ps = getattr(pool, "page_size", None)
    size = getattr(pool, "size", None)
    if not isinstance(ps, int) or ps <= 0 or not isinstance(size, int) or size <= 0:
        raise ValueError("kvside: the host pool has no positive page_size/size")
    if getattr(pool, "kv_buffer", None) is None:
        raise ValueError("kvside: the host pool %s holds no KV buffer (a hybrid model's logical anchor "
                         "pool?): hybrid models (SGLang's v2 storage interface) are not supported"
                         % type(pool).__name__)
    if size % ps:
        raise ValueError("kvside: host pool size %d is not a multiple of page_size %d" % (size, ps))
    num_pages = size // ps
    if num_pages < 2:
        raise ValueError("kvside: the host pool has fewer than 2 pages")
    if not hasattr(pool, "get_page_buffer_meta"):
        raise ValueError("kvside: the host pool %s has no get_page_buffer_meta (zero-copy interface)"
                         % type(pool).__name__)

    def meta(p):
        idx = torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(idx)
        except ValueError as e:
            raise ValueError("kvside: the host pool's layout %r has no zero-copy page metadata (%s); use "
                             "--hicache-mem-layout page_first, page_first_direct or layer_first"
                             % (getattr(pool, "layout", "?"), e)) from None
        ptrs, sizes = [int(x) for x in ptrs], [int(x) for x in sizes]
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError("kvside: get_page_buffer_meta gave %d pointers and %d sizes for one page"
                             % (len(ptrs), len(sizes)))
        return ptrs, sizes

    p0, s0 = meta(0)
    p1, s1 = meta(1)
    pl, sl = meta(num_pages - 1)
    if not (len(p0) == len(p1) == len(pl)) or s0 != s1 or s0 != sl:
        raise ValueError("kvside: the host pool's pages are not uniform (get_page_buffer_meta)")
    if len(p0) > 1024:
        raise ValueError("kvside: %d views per page exceed kvside's 1024 layers per registration"
                         % len(p0))
    views = []
    for j, (a, b, z, n) in enumerate(zip(p0, p1, pl, s0)):
        stride = b - a
        if n <= 0 or stride < n or z != a + (num_pages - 1) * stride:
            raise ValueError("kvside: view %d of the host pool is not a strided run of pages (page 0 at "
                             "0x%x, page 1 at 0x%x, page %d at 0x%x, %d bytes)" % (j, a, b, num_pages - 1,
                                                                                  z, n))
        views.append(_layout.View(a, stride, n))
    return views, num_pages


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def namespace_of(cfg, storage_config, pool, views):
    """The kvside namespace of an SGLang model: everything that makes two
    engines' bytes for one page hash differ (model, MHA/MLA, TP size unless
    MLA, pipeline stage, context-parallel rank, host layout, page size, KV
    dtype, the per-page view sizes), plus the salt; at most 128 bytes."""
    if cfg.namespace:
        return cfg.namespace
    sc = storage_config
    mla = bool(sc.is_mla_model)
    desc = "|".join([
        "sglang", str(sc.model_name or ""), "mla" if mla else "mha",
        "tp*" if mla else "tp%d" % sc.tp_size,
        "pp%d/%d" % (getattr(sc, "pp_rank", 0), getattr(sc, "pp_size", 1)),
        "cp%d/%d" % (getattr(sc, "attn_cp_rank", 0), getattr(sc, "attn_cp_size", 1)),
        str(getattr(pool, "layout", "")), "ps%d" % pool.page_size, _dtype_name(getattr(pool, "dtype", "")),
        "v" + ",".join("%d" % v.block_bytes for v in views), cfg.namespace_salt])
    model = str(sc.model_name or "model").replace("|", "_")[-48:]
    return "sglang|%s|%s" % (model, hashlib.blake2b(desc.encode(), digest_size=16).hexdigest())


def page_key(ns_digest, page_hash):
    """The 32-byte kvside key of an SGLang page hash (a string: SGLang's page
    hashes chain the whole prefix, and whatever SGLang mixes into them)."""
    return hashlib.blake2b(page_hash.encode(), digest_size=32, key=ns_digest, person=b"kvside-sglang").digest()


def _agree_nonce(need):
    """A random id every rank of this SGLang instance shares: rank 0 of the
    torch.distributed world draws it and broadcasts it (a collective: every
    rank constructs its backend at attach). Without torch.distributed only a
    rank that needs no partner may go on."""
    try:
        import torch.distributed as dist
        ready = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        ready = False
    if ready:
        obj = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]
    if need:
        raise RuntimeError("kvside: torch.distributed is not initialized, so the TP ranks cannot agree "
                           "on job ids (SGLang initialises it before the hierarchical cache)")
    return os.urandom(8).hex()


# ---- the backend ------------------------------------------------------------------------

class KvsideStorage(HiCacheStorage):
    """SGLang HiCache storage backend over kvside-server (one per TP rank).

    Constructed by SGLang's StorageBackendFactory as
    ``KvsideStorage(storage_config, kwargs)``; the pool arrives through
    ``register_mem_pool_host``. Runtime failures (server down, misses,
    time-outs) are reported as misses / failed pages and logged; bad input
    raises ValueError or TypeError."""

    def __init__(self, storage_config, kwargs=None):
        sc = storage_config
        if sc is None:
            raise ValueError("kvside: KvsideStorage needs SGLang's HiCacheStorageConfig")
        self.cfg = StorageConfig.from_extra(getattr(sc, "extra_config", None))
        tp_rank, tp_size = int(sc.tp_rank), int(sc.tp_size)
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError("kvside: tp_rank %d outside tp_size %d" % (tp_rank, tp_size))
        if getattr(sc, "should_split_heads", False):
            raise ValueError("kvside: heterogeneous TP (tp_lcm_size > tp_size, split heads) is not supported")
        self.storage_config = sc
        self.is_mla = bool(sc.is_mla_model)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # MLA pools are the same on every TP rank: each rank is a world of one
        # reading the objects TP rank 0 stored
        self.world, self.rank = (1, 0) if self.is_mla else (tp_size, tp_rank)
        nonce = _agree_nonce(self.world > 1)
        self.engine = "sglang-%s-pp%d-dp%d-cp%d" % (nonce, getattr(sc, "pp_rank", 0), getattr(sc, "dp_rank", 0),
                                                  getattr(sc, "attn_cp_rank", 0))
        if self.is_mla:
            self.engine += "-tp%d" % tp_rank
        self.client, self.handle, self.namespace, self._ns_digest = None, None, None, None
        self.num_pages = 0
        self.mem_pool_host = None
        self._lock = threading.Lock()
        self._occ = {"get": OrderedDict(), "set": OrderedDict()}
        self.stats = {"exists_calls": 0, "exists_hits": 0, "gets": 0, "get_pages": 0, "get_failed_pages": 0,
                      "sets": 0, "set_pages": 0, "set_failed_pages": 0, "jobs_deadline": 0,
                      "reconnects": 0}
        self._warned = 0.0

    # -- registration

    def register_mem_pool_host(self, mem_pool_host):
        """Registers the rank's host pool with the server: one registration,
        every page of every view (the pool must live in shareable host
        memory: SGLang's "allocator": "shm", or its default shared mapping)."""
        if self.client is not None:
            raise RuntimeError("kvside: a host pool is already registered with this backend")
        super().register_mem_pool_host(mem_pool_host)
        views, num_pages = pool_views(mem_pool_host)
        self.namespace = namespace_of(self.cfg, self.storage_config, mem_pool_host, views)
        self._ns_digest = hashlib.blake2b(self.namespace.encode(), digest_size=32).digest()
        allocs, by_inode, layers = [], {}, []
        try:
            for j, v in enumerate(views):
                lo, hi = _layout.view_extent(v, num_pages)
                a = _layout.host_allocation(lo, hi - lo, "SGLang host KV pool (view %d)" % j)
                if a.inode in by_inode:
                    os.close(a.fd)
                    a = allocs[by_inode[a.inode]]
                else:
                    by_inode[a.inode] = len(allocs)
                    allocs.append(a)
                layers.append(kvside.Layer(0, by_inode[a.inode], lo - a.map_start + a.file_offset, num_pages,
                                           v.block_stride, v.block_bytes))
            groups = [kvside.Group(0, "attention", tokens_per_block=mem_pool_host.page_size, blocks_per_chunk=1)]
            client = kvside.Client(self.engine, self.namespace, role="worker", rank=self.rank, world=self.world,
                                   broker_dir=self.cfg.broker_dir, endpoint=self.cfg.endpoint,
                                   timeout_ms=self.cfg.timeout_ms, on_event=self._on_event)
            try:
                self.handle = client.register_memory([(a.fd, a.size) for a in allocs], groups, layers)
            except kvside.KvsideError as e:
                client.close()
                if e.code_name == "E_DEVICE":
                    raise RuntimeError(
                        "kvside: the server refused SGLang's host pool (%s). SGLang's pool memory cannot be "
                        "sealed against shrinking: start kvside-server with --allow-unsealed-memory true "
                        "(docs/sglang.md)" % e) from None
                raise
        finally:
            for a in allocs:
                os.close(a.fd)
        self.client, self.num_pages, self.page_size = client, num_pages, mem_pool_host.page_size
        log.info("kvside: registered the host pool (%d pages, %d views) as rank %d/%d of %s, engine %s",
                 num_pages, len(views), self.rank, self.world, self.namespace, self.engine)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if str(host_pool_name) == "kv" and (host_pool is self.mem_pool_host or self.mem_pool_host is None):
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            return
        raise ValueError("kvside: extra host pool %r: hybrid models (SGLang's v2 storage interface with "
                         "Mamba/SWA/indexer pools) are not supported by kvside.sglang" % (str(host_pool_name),))

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None

    def _on_event(self, ev):
        if ev.type == "reconnected":
            # the server restarted: the library re-registered the pool (lookups
            # also answer from L2 before that)
            self.stats["reconnects"] += 1
            if ev.error:
                log.warning("kvside: re-registering the host pool after a server restart failed (%d)", ev.error)
        elif ev.type == "job_done" and ev.state == "aborted" and "deadline" in ev.reason:
            self.stats["jobs_deadline"] += 1
            now = time.monotonic()
            if now - self._warned > 60:
                self._warned = now
                log.warning("kvside: job %d of %s ended at the server's deadline without every TP rank's "
                            "part (after a partial miss or a prefetch one rank ended early this is expected; "
                            "for sets it means a rank stalled or the ranks' calls diverged)", ev.job, self.engine)

    # -- inputs

    def _keys(self, keys):
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError("kvside: keys must be a list of SGLang page hashes (strings)")
        if len(keys) > MAX_KEYS:
            raise ValueError("kvside: %d keys in one call exceed kvside's %d" % (len(keys), MAX_KEYS))
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError("kvside: a page hash must be a non-empty string, not %r" % (k,))
            out.append(page_key(self._ns_digest, k))
        return out

    def _pages(self, n, host_indices):
        """Host page ids of n pages from SGLang's token indices (page_size
        consecutive, page-aligned slots per page)."""
        import torch
        ps = self.page_size
        t = host_indices
        if not isinstance(t, torch.Tensor):
            try:
                t = torch.as_tensor(list(t), dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError("kvside: host_indices must be a tensor or a sequence of integers") from None
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError("kvside: host_indices must hold integers, not %s" % t.dtype)
        t = t.reshape(-1).to(device="cpu", dtype=torch.int64)
        if t.numel() != n * ps:
            raise ValueError("kvside: %d host indices for %d pages of %d tokens (need %d)"
                             % (t.numel(), n, ps, n * ps))
        if n == 0:
            return []
        t = t.reshape(n, ps)
        first = t[:, 0]
        if bool((first % ps != 0).any()) or bool((t != first[:, None] + torch.arange(ps)).any()):
            raise ValueError("kvside: host indices are not whole pages (page_size %d consecutive slots from a "
                             "multiple of page_size)" % ps)
        pages = (first // ps).tolist()
        if min(pages) < 0 or max(pages) >= self.num_pages:
            raise ValueError("kvside: host indices outside the registered pool (%d pages)" % self.num_pages)
        return pages

    def _job(self, op, parts):
        """A job id every rank derives alike: the engine, the operation, the
        digest of its parts, and how often this rank has run that digest."""
        d = hashlib.blake2b(digest_size=16)
        for p in parts:
            d.update(p if isinstance(p, bytes) else repr(p).encode())
            d.update(b"\0")
        digest = d.digest()
        with self._lock:
            occ = self._occ[op]
            n = occ.pop(digest, 0)
            occ[digest] = n + 1
            if len(occ) > _LRU:
                occ.popitem(last=False)
        h = hashlib.blake2b(b"%s|%s|%s|%d" % (self.engine.encode(), op.encode(), digest, n), digest_size=8)
        return (int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)) or 1

    def _ready(self, what):
        if self.client is None:
            raise RuntimeError("kvside: %s before register_mem_pool_host" % what)

    # -- the v1 (zero-copy) interface

    def batch_exists(self, keys, extra_info=None):
        """How many leading pages are stored on every rank of this world (a
        kvside lookup: L1 or L2). The hit is pinned in L1 for pin_ms and L2
        hits start moving to L1, so the get that follows finds them."""
        self._ready("batch_exists")
        kk = self._keys(keys)
        if not kk:
            return 0
        self.stats["exists_calls"] += 1
        try:
            hits = self.client.lookup(kk, prefetch=self.cfg.prefetch, pin_ms=self.cfg.pin_ms,
                                      timeout_ms=self.cfg.lookup_timeout_ms).hits
        except kvside.KvsideError as e:
            log.warning("kvside: lookup of %d pages failed (%s): no hit", len(kk), e)
            return 0
        self.stats["exists_hits"] += hits
        return int(hits)

    def exists(self, key):
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Copies stored pages into the host pool pages host_indices names.
        Returns one bool per key: True only for pages whose bytes are in place
        (a leading run: on a miss the pages before it are fetched again)."""
        self._ready("batch_get_v1")
        kk = self._keys(keys)
        pages = self._pages(len(kk), host_indices)
        n = len(kk)
        if not n:
            return []
        self.stats["gets"] += 1
        got = self._retrieve(kk, pages)
        if got < n:
            # a page was evicted since batch_exists, or another rank's part
            # was refused: fetch what every rank still has, once
            h = self._lookup_quiet(kk)
            got = h if h and self._retrieve(kk[:h], pages[:h]) == h else 0
        self.stats["get_pages"] += got
        self.stats["get_failed_pages"] += n - got
        return [i < got for i in range(n)]

    def _lookup_quiet(self, kk):
        try:
            return self.client.lookup(kk, timeout_ms=self.cfg.lookup_timeout_ms).hits
        except kvside.KvsideError:
            return 0

    def _retrieve(self, kk, pages):
        """One retrieve job of these pages: len(kk) if the bytes are in place,
        else 0. A part's reply comes once this rank's copies ended, so the
        rank does not wait for the others (their parts commit the job)."""
        job = self._job("get", kk + pages)
        c = self.client
        reconnects = c.reconnects
        try:
            p = c.retrieve_async(job, b"".join(kk), [pages], timeout_ms=self.cfg.load_timeout_ms)
            c.complete_async(job, True, timeout_ms=self.cfg.load_timeout_ms)
            state = p.result(self.cfg.load_timeout_ms / 1000.0 + 1.0)
        except kvside.KvsideError as e:
            if e.code_name != "E_MISS":
                log.warning("kvside: get of %d pages failed (%s)", len(kk), e)
            if e.code_name in ("ETIMEDOUT", "E_TIMEOUT"):
                # the server may still write into the pages (a slow L2
                # promotion): SGLang may reuse them only once the job ended
                self._wait_end(job, reconnects)
            return 0
        # "open": this rank's bytes are in place. "aborted": another rank's
        # part was refused (whether ours copied is unknown: report a miss).
        # "committed": a repeat of a job that already ended (nothing copied).
        return len(kk) if state == "open" else 0

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Stores the host pool pages host_indices names under keys: one job
        spanning every rank of the world, committed once all have sent their
        part. Returns once the job ended (the server no longer reads the
        pages): all True if it committed, else all False."""
        self._ready("batch_set_v1")
        kk = self._keys(keys)
        pages = self._pages(len(kk), host_indices)
        n = len(kk)
        if not n:
            return []
        self.stats["sets"] += 1
        ok = self._store(kk, pages)
        self.stats["set_pages" if ok else "set_failed_pages"] += n
        return [ok] * n

    def _store(self, kk, pages):
        # the id covers the keys, not the host pages: ranks hold the same
        # pages in different slots only if their pools diverged, and then the
        # job still has one id (the part digests differ per rank, not per job)
        job = self._job("set", kk)
        c = self.client
        reconnects = c.reconnects
        try:
            p = c.store_async(job, b"".join(kk), [pages], timeout_ms=self.cfg.timeout_ms)
            c.complete_async(job, True, timeout_ms=self.cfg.timeout_ms)
            p.result(self.cfg.timeout_ms / 1000.0 + 1.0)
        except kvside.KvsideError as e:
            if e.code_name == "E_JOB_CONFLICT":
                log.warning("kvside: set of %d pages refused: another rank sent other pages under the same "
                            "job (the TP ranks' calls diverged)", len(kk))
            else:
                log.warning("kvside: set of %d pages failed (%s)", len(kk), e)
            if e.code_name in ("ETIMEDOUT", "E_TIMEOUT"):
                # the part may have reached the server, which may still read
                # the pages: they are SGLang's again only once the job ended
                return self._wait_end(job, reconnects) == "committed"
            return False
        return self._wait_end(job, reconnects) == "committed"

    def _wait_end(self, job, reconnects):
        deadline = time.monotonic() + self.cfg.store_wait_ms / 1000.0
        c = self.client
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("kvside: job %d did not end within store_wait_ms (%d ms)", job,
                            self.cfg.store_wait_ms)
                return None
            try:
                return c.job_wait(job, timeout_ms=max(1, int(min(left, 0.5) * 1000)))
            except kvside.KvsideError as e:
                if e.code_name not in ("E_TIMEOUT", "ETIMEDOUT"):
                    log.warning("kvside: waiting for job %d failed (%s)", job, e)
                    return None
            if c.reconnects != reconnects:
                return None  # the server restarted: the job is gone

    # -- the non-zero-copy interface (SGLang uses it only without interface_v1)

    def _no_copy_path(self, *a, **k):
        raise NotImplementedError("kvside: only SGLang's zero-copy interface is supported; set "
                                  "\"interface_v1\": 1 in --hicache-storage-backend-extra-config")

    def get(self, key, target_location=None, target_sizes=None):
        self._no_copy_path()

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._no_copy_path()

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self._no_copy_path()

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        self._no_copy_path()

    # -- hybrid (v2) interface: not supported

    def _no_hybrid(self):
        raise NotImplementedError("kvside: hybrid models (SGLang's v2 storage interface) are not supported")

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        self._no_hybrid()

    def batch_get_v2(self, transfers, extra_info=None):
        self._no_hybrid()

    def batch_set_v2(self, transfers, extra_info=None):
        self._no_hybrid()

    # -- housekeeping

    def clear(self):
        """Not forwarded: kvside's clear drops every engine's objects
        (kvside-ctl clear does that on purpose)."""
        log.info("kvside: clear() ignored; use kvside-ctl clear to drop the server's whole cache")

    def get_stats(self):
        return None
