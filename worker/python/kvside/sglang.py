"""kvside.sglang: an L3 storage backend for SGLang's hierarchical cache
(HiCache), loaded through SGLang's ``dynamic`` storage backend (docs/sglang.md).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvside",
        "module_path": "kvside.sglang", "class_name": "KvsideStorage",
        "interface_v1": 1, "allocator": "shm", "broker_dir": "/run/kvside"}'

Written against sgl-project/sglang at 001067fffe33427bee0ed2f007fb7551a1d76b44
(hicache_storage.py, storage/backend_factory.py, managers/cache_controller.py;
the hybrid controller, host pools and allocators at the commits
tests/sglang/stub cites).
Importing this module needs SGLang (the HiCacheStorage base class).

How it maps (each decision is explained in docs/sglang.md):
- one kvside chunk = one SGLang page; its key is SGLang's page hash (which
  already chains the whole prefix) hashed with the namespace;
- the rank's host pool is registered ONCE (every page of every layer, K and
  V, as kvside layer views derived from ``get_page_buffer_meta``), so gets and
  sets are zero-copy between the pool and the server;
- hybrid models (SGLang's v2 interface: register_mem_host_pool_v2,
  batch_exists_v2 / batch_get_v2 / batch_set_v2 with PoolTransfers): every
  side pool is a registration of its own (own session and namespace): the
  Mamba state pool a kvside recurrent group (a slot = the state at the end of
  one page), SWA / indexer / draft pools full-attention groups of their
  pages; batch_exists_v2 answers the longest prefix that KV and every pool's
  hit policy allow at once; DeepSeek V4's pools and logical anchors are
  refused;
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
from kvside import settings as _settings  # noqa: E402

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
        _settings.assign(cfg, known, extra.items())
        for k in ("timeout_ms", "lookup_timeout_ms", "load_timeout_ms", "store_wait_ms"):
            if getattr(cfg, k) <= 0:
                raise ValueError("kvside: %s must be positive" % k)
        if cfg.pin_ms > 600000:
            raise ValueError("kvside: pin_ms must be at most 600000")
        if cfg.namespace is not None and not 0 < len(cfg.namespace.encode()) <= 128:
            raise ValueError("kvside: namespace must be 1..128 bytes")
        return cfg


# ---- the host pool as kvside views ------------------------------------------------------

def pool_views(pool, name="kv"):
    """(views, num_pages): the kvside layer views of an SGLang host pool, one
    per (pointer) entry that ``get_page_buffer_meta`` returns for a page (K and
    V of every layer for layer_first MHA; K and V page slabs for page_first,
    page_first_direct and page_head; one slab or one per layer for MLA; the
    temporal state then each conv state of a Mamba slot, each covering every
    Mamba layer). Block p of view j is page p. The views are checked to be linear in the page
    index over the whole pool, so the bytes kvside moves for a page are
    exactly the bytes SGLang's zero-copy backends move for it."""
    import torch
    what = "the host pool" if name == "kv" else "host pool %r" % name
    ps = getattr(pool, "page_size", None)
    size = getattr(pool, "size", None)
    if not isinstance(ps, int) or ps <= 0 or not isinstance(size, int) or size <= 0:
        raise ValueError("kvside: %s has no positive page_size/size" % what)
    if getattr(pool, "kv_buffer", None) is None:
        raise ValueError("kvside: %s (%s) holds no KV buffer (a logical pool only hands out indices): "
                         "kvside has no bytes to register" % (what, type(pool).__name__))
    if size % ps:
        raise ValueError("kvside: %s: size %d is not a multiple of page_size %d" % (what, size, ps))
    num_pages = size // ps
    if num_pages < 2:
        raise ValueError("kvside: %s has fewer than 2 pages" % what)
    if not hasattr(pool, "get_page_buffer_meta"):
        raise ValueError("kvside: %s (%s) has no get_page_buffer_meta (zero-copy interface)"
                         % (what, type(pool).__name__))

    def meta(p):
        idx = torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64)
        try:
            m = pool.get_page_buffer_meta(idx)
        except (ValueError, AssertionError) as e:
            raise ValueError("kvside: %s: layout %r has no zero-copy page metadata (%s); use "
                             "--hicache-mem-layout page_first, page_first_direct or layer_first (a Mamba "
                             "pool: page_first or page_first_direct)" % (what, getattr(pool, "layout", "?"), e)) from None
        if m is None:
            raise ValueError("kvside: %s (%s) gives no zero-copy page metadata" % (what, type(pool).__name__))
        ptrs, sizes = [int(x) for x in m[0]], [int(x) for x in m[1]]
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError("kvside: %s: get_page_buffer_meta gave %d pointers and %d sizes for one page"
                             % (what, len(ptrs), len(sizes)))
        return ptrs, sizes

    p0, s0 = meta(0)
    p1, s1 = meta(1)
    pl, sl = meta(num_pages - 1)
    if not (len(p0) == len(p1) == len(pl)) or s0 != s1 or s0 != sl:
        raise ValueError("kvside: %s: the pages are not uniform (get_page_buffer_meta)" % what)
    if len(p0) > 1024:
        raise ValueError("kvside: %s: %d views per page exceed kvside's 1024 layers per registration"
                         % (what, len(p0)))
    views = []
    for j, (a, b, z, n) in enumerate(zip(p0, p1, pl, s0)):
        stride = b - a
        if n <= 0 or stride < n or z != a + (num_pages - 1) * stride:
            raise ValueError("kvside: view %d of %s is not a strided run of pages (page 0 at "
                             "0x%x, page 1 at 0x%x, page %d at 0x%x, %d bytes)" % (j, what, a, b, num_pages - 1,
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


# ---- hybrid pools (SGLang's v2 interface) -----------------------------------------------

MAMBA = "mamba"
KV = "kv"
# SGLang's DeepSeek V4 pools (PoolName.DEEPSEEK_V4_*): refused, docs/sglang.md says why
_REFUSED_PREFIX = "deepseek_v4"
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"
_TRAILING_STEPS = 64     # lookups one trailing-window search of an attention pool may take


def _name(x):
    """A pool name as a plain string (SGLang's PoolName is a str Enum whose
    str() is its value)."""
    v = getattr(x, "value", x)
    if not isinstance(v, str) or not v:
        raise TypeError("kvside: a pool name must be a non-empty string (SGLang's PoolName), not %r" % (x,))
    return v


def _policy(p):
    v = getattr(p, "value", p)
    if v not in (ALL_PAGES, TRAILING_PAGES):
        raise ValueError("kvside: unknown pool hit policy %r (SGLang's PoolHitPolicy: all_pages, "
                         "trailing_pages)" % (p,))
    return v


class _Reg:
    """One kvside registration: a host pool of this rank as one group of one
    kvside session (KV, or one of SGLang's hybrid side pools)."""

    __slots__ = ("name", "pool", "kind", "replicated", "world", "rank", "engine", "namespace", "ns_digest",
                 "client", "handle", "num_pages", "page_size", "views", "reconnects")

    def __init__(self, name, pool, kind, replicated):
        self.name, self.pool, self.kind, self.replicated = name, pool, kind, replicated
        self.client = self.handle = self.namespace = self.ns_digest = None
        self.num_pages = self.page_size = 0
        self.world, self.rank, self.engine, self.views, self.reconnects = 1, 0, None, [], 0


try:  # SGLang at 001067ff defines it next to HiCacheStorage; batch_exists_v2 answers it
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
except ImportError:  # pragma: no cover - an SGLang without the v2 interface never calls it
    class PoolTransferResult:
        def __init__(self, kv_hit_pages, extra_pool_hit_pages):
            self.kv_hit_pages, self.extra_pool_hit_pages = kv_hit_pages, extra_pool_hit_pages


# ---- the backend ------------------------------------------------------------------------

class KvsideStorage(HiCacheStorage):
    """SGLang HiCache storage backend over kvside-server (one per TP rank).

    Constructed by SGLang's StorageBackendFactory as
    ``KvsideStorage(storage_config, kwargs)``; the KV pool arrives through
    ``register_mem_pool_host``, a hybrid model's side pools (Mamba states,
    SWA, DSA indexer, draft) through ``register_mem_host_pool_v2``: each pool
    is its own kvside registration (docs/sglang.md, "Hybrid models").
    Runtime failures (server down, misses, time-outs) are reported as misses
    / failed pages and logged; bad input raises ValueError or TypeError."""

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
        # every rank takes part: a Mamba side pool is TP-sharded even for MLA
        nonce = _agree_nonce(tp_size > 1)
        self._engine_base = "sglang-%s-pp%d-dp%d-cp%d" % (nonce, getattr(sc, "pp_rank", 0),
                                                          getattr(sc, "dp_rank", 0), getattr(sc, "attn_cp_rank", 0))
        self.engine = self._engine_base + ("-tp%d" % tp_rank if self.is_mla else "")
        self.client, self.handle, self.namespace, self._ns_digest = None, None, None, None
        self.num_pages = 0
        self.mem_pool_host = None
        self.regs = {}            # pool name -> _Reg ("kv" once register_mem_pool_host ran)
        self._lock = threading.Lock()
        self._reg_lock = threading.Lock()
        self._occ = {}
        self.stats = {"exists_calls": 0, "exists_hits": 0, "gets": 0, "get_pages": 0, "get_failed_pages": 0,
                      "sets": 0, "set_pages": 0, "set_failed_pages": 0, "jobs_deadline": 0,
                      "reconnects": 0, "v2_exists_calls": 0, "v2_gets": 0, "v2_get_pages": 0,
                      "v2_get_failed_pages": 0, "v2_sets": 0, "v2_set_pages": 0, "v2_set_failed_pages": 0,
                      "trailing_search_capped": 0, "set_messages": 0}
        self._warned = 0.0

    # -- registration

    def register_mem_pool_host(self, mem_pool_host):
        """Registers the rank's KV host pool with the server: one registration,
        every page of every view (the pool must live in shareable host
        memory: SGLang's "allocator": "shm", or its default shared mapping)."""
        if self.client is not None:
            raise RuntimeError("kvside: a host pool is already registered with this backend")
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ValueError("kvside: the host pool %s holds no KV buffer: a logical anchor (DeepSeek V4's "
                             "KV anchor pool only hands out indices, its bytes live in the deepseek_v4_* side "
                             "pools) is not supported by kvside.sglang (docs/sglang.md)"
                             % type(mem_pool_host).__name__)
        super().register_mem_pool_host(mem_pool_host)
        reg = _Reg(KV, mem_pool_host, "attention", self.is_mla)
        self._register(reg)
        self.regs[KV] = reg
        self.client, self.handle, self.namespace = reg.client, reg.handle, reg.namespace
        self._ns_digest, self.num_pages, self.page_size = reg.ns_digest, reg.num_pages, reg.page_size

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Registers one of a hybrid model's host pools (SGLang's
        HybridCacheController calls it for every entry of its HostPoolGroup,
        the KV anchor included, after register_mem_pool_host). Each side pool
        becomes its own kvside registration: "mamba" (one state per slot) a
        recurrent group, every other pool (SWA, DSA indexer, draft KV) a
        full-attention group of its pages. DeepSeek V4's pools are refused."""
        name = _name(host_pool_name)
        if self.client is None:
            raise RuntimeError("kvside: register_mem_host_pool_v2(%r) before register_mem_pool_host" % name)
        if name == KV or host_pool is self.mem_pool_host:
            if host_pool is not self.mem_pool_host:
                raise ValueError("kvside: pool 'kv' is not the host pool register_mem_pool_host registered")
            if name != KV:  # the anchor under another name: the same registration
                self.regs.setdefault(name, self.regs[KV])
            return
        if name.startswith(_REFUSED_PREFIX):
            raise ValueError("kvside: DeepSeek V4's host pool %r is not supported by kvside.sglang: its KV "
                             "anchor is logical (no bytes) and its compressed pools address pages through "
                             "the anchor's indices scaled per pool, which this backend cannot check against "
                             "the pool (docs/sglang.md)" % name)
        if name == MAMBA and getattr(host_pool, "page_size", None) != 1:
            raise ValueError("kvside: host pool %r has page_size %r: SGLang's Mamba host pool holds one state "
                             "per slot (page_size 1), kvside stores it as a recurrent group"
                             % (name, getattr(host_pool, "page_size", None)))
        with self._reg_lock:
            old = self.regs.get(name)
            if old is not None:
                if old.pool is host_pool:
                    return
                raise ValueError("kvside: another host pool is already registered as %r" % name)
            if name == MAMBA:
                # TP-sharded state even when the KV pool is replicated (MLA)
                reg = _Reg(name, host_pool, "recurrent", False)
            else:
                reg = _Reg(name, host_pool, "attention", self.is_mla)
            self._register(reg)
            self.regs[name] = reg
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def _register(self, reg):
        """Opens reg's session and registers its pool: one group, every page
        of every view of get_page_buffer_meta."""
        pool = reg.pool
        views, num_pages = pool_views(pool, reg.name)
        reg.world, reg.rank = (1, 0) if reg.replicated else (self.tp_size, self.tp_rank)
        reg.engine = self._engine_base + ("-tp%d" % self.tp_rank if reg.replicated else "")
        if reg.name != KV:
            reg.engine += "/" + reg.name[:32]
        reg.namespace = self._namespace(reg, views)
        reg.ns_digest = hashlib.blake2b(reg.namespace.encode(), digest_size=32).digest()
        what = "SGLang host pool %r" % reg.name
        allocs, by_inode, layers = [], {}, []
        try:
            for j, v in enumerate(views):
                lo, hi = _layout.view_extent(v, num_pages)
                a = _layout.host_allocation(lo, hi - lo, "%s (view %d)" % (what, j))
                if a.inode in by_inode:
                    os.close(a.fd)
                    a = allocs[by_inode[a.inode]]
                else:
                    by_inode[a.inode] = len(allocs)
                    allocs.append(a)
                layers.append(kvside.Layer(0, by_inode[a.inode], lo - a.map_start + a.file_offset, num_pages,
                                           v.block_stride, v.block_bytes))
            if len(allocs) > 256:
                raise ValueError("kvside: %s spans %d files, more than kvside's 256 allocations per "
                                 "registration" % (what, len(allocs)))
            # one kvside chunk = one SGLang page (of the KV pool: a Mamba slot
            # holds the state at the end of one KV page)
            tpb = self.mem_pool_host.page_size if reg.kind == "recurrent" else pool.page_size
            groups = [kvside.Group(0, reg.kind, tokens_per_block=tpb, blocks_per_chunk=1)]
            client = kvside.Client(reg.engine, reg.namespace, role="worker", rank=reg.rank, world=reg.world,
                                   broker_dir=self.cfg.broker_dir, endpoint=self.cfg.endpoint,
                                   timeout_ms=self.cfg.timeout_ms, on_event=self._on_event_of(reg))
            try:
                handle = client.register_memory([(a.fd, a.size) for a in allocs], groups, layers)
            except kvside.KvsideError as e:
                client.close()
                if e.code_name == "E_DEVICE":
                    raise RuntimeError(
                        "kvside: the server refused %s (%s). SGLang's pool memory cannot be sealed against "
                        "shrinking: start kvside-server with --allow-unsealed-memory true (docs/sglang.md)"
                        % (what, e)) from None
                raise
        finally:
            for a in allocs:
                os.close(a.fd)
        reg.client, reg.handle, reg.num_pages, reg.page_size, reg.views = client, handle, num_pages, pool.page_size, views
        log.info("kvside: registered %s (%d pages, %d views, %s group) as rank %d/%d of %s, engine %s",
                 what, num_pages, len(views), reg.kind, reg.rank, reg.world, reg.namespace, reg.engine)

    def _namespace(self, reg, views):
        if reg.name == KV:
            return namespace_of(self.cfg, self.storage_config, reg.pool, views)
        kv = self.regs[KV].namespace
        if self.cfg.namespace:
            ns = "%s|%s" % (self.cfg.namespace, reg.name)
            if len(ns.encode()) > 128:
                raise ValueError("kvside: namespace %r plus the pool name %r exceed 128 bytes" % (self.cfg.namespace,
                                                                                                   reg.name))
            return ns
        pool, sc = reg.pool, self.storage_config
        dtypes = [getattr(pool, a, None) for a in ("dtype", "conv_dtype", "temporal_dtype")]
        desc = "|".join([
            "sglang-pool", kv, reg.name, reg.kind, "tp*" if reg.replicated else "tp%d" % sc.tp_size,
            type(pool).__name__, str(getattr(pool, "layout", "")), "ps%d" % pool.page_size,
            ",".join(_dtype_name(d) for d in dtypes if d is not None),
            "v" + ",".join("%d" % v.block_bytes for v in views), self.cfg.namespace_salt])
        model = str(sc.model_name or "model").replace("|", "_")[-48:]
        return "sglang|%s|%s|%s" % (model, reg.name[:24], hashlib.blake2b(desc.encode(), digest_size=16).hexdigest())

    def close(self):
        for reg in set(self.regs.values()):
            if reg.client is not None:
                reg.client.close()
                reg.client = None
        self.client = None

    def _on_event_of(self, reg):
        def on_event(ev):
            if ev.type == "reconnected":
                # the server restarted: the library re-registered the pool
                # (lookups also answer from L2 before that)
                reg.reconnects += 1
                if reg.name == KV:
                    self.stats["reconnects"] += 1
                if ev.error:
                    log.warning("kvside: re-registering SGLang host pool %r after a server restart failed (%d)",
                                reg.name, ev.error)
            elif ev.type == "job_done" and ev.state == "aborted" and "deadline" in ev.reason:
                self.stats["jobs_deadline"] += 1
                now = time.monotonic()
                if now - self._warned > 60:
                    self._warned = now
                    log.warning("kvside: job %d of %s ended at the server's deadline without every TP rank's "
                                "part (after a partial miss or a prefetch one rank ended early this is "
                                "expected; for sets it means a rank stalled or the ranks' calls diverged)",
                                ev.job, reg.engine)
        return on_event

    # -- inputs

    def _keys(self, keys, reg=None):
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError("kvside: keys must be a list of SGLang page hashes (strings)")
        digest = (reg or self.regs[KV]).ns_digest
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError("kvside: a page hash must be a non-empty string, not %r" % (k,))
            out.append(page_key(digest, k))
        return out

    def _v1_keys(self, keys):
        if not isinstance(keys, (str, bytes)) and hasattr(keys, "__len__") and len(keys) > MAX_KEYS:
            raise ValueError("kvside: %d keys in one call exceed kvside's %d" % (len(keys), MAX_KEYS))
        return self._keys(keys)

    def _pages(self, n, host_indices, reg=None):
        """Host page ids of n pages from SGLang's host indices (page_size
        consecutive, page-aligned slots per page; a Mamba slot is a page)."""
        import torch
        reg = reg or self.regs[KV]
        ps = reg.page_size
        t = host_indices
        if t is None:
            raise ValueError("kvside: pool %r: no host indices" % reg.name)
        if not isinstance(t, torch.Tensor):
            try:
                t = torch.as_tensor(list(t), dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError("kvside: host_indices must be a tensor or a sequence of integers") from None
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError("kvside: host_indices must hold integers, not %s" % t.dtype)
        t = t.reshape(-1).to(device="cpu", dtype=torch.int64)
        if t.numel() != n * ps:
            raise ValueError("kvside: %d host indices for %d pages of %d tokens (need %d)%s"
                             % (t.numel(), n, ps, n * ps, "" if reg.name == KV else " in pool %r" % reg.name))
        if n == 0:
            return []
        t = t.reshape(n, ps)
        first = t[:, 0]
        if bool((first % ps != 0).any()) or bool((t != first[:, None] + torch.arange(ps)).any()):
            raise ValueError("kvside: host indices are not whole pages (page_size %d consecutive slots from a "
                             "multiple of page_size)" % ps)
        pages = (first // ps).tolist()
        if min(pages) < 0 or max(pages) >= reg.num_pages:
            raise ValueError("kvside: host indices outside the registered pool%s (%d pages)"
                             % ("" if reg.name == KV else " %r" % reg.name, reg.num_pages))
        return pages

    def _job(self, op, parts, reg=None):
        """A job id every rank derives alike: the engine, the operation, the
        digest of its parts, and how often this rank has run that digest."""
        reg = reg or self.regs[KV]
        d = hashlib.blake2b(digest_size=16)
        for p in parts:
            d.update(p if isinstance(p, bytes) else repr(p).encode())
            d.update(b"\0")
        digest = d.digest()
        with self._lock:
            occ = self._occ.setdefault((reg.name, op), OrderedDict())
            n = occ.pop(digest, 0)
            occ[digest] = n + 1
            if len(occ) > _LRU:
                occ.popitem(last=False)
        h = hashlib.blake2b(b"%s|%s|%s|%d" % (reg.engine.encode(), op.encode(), digest, n), digest_size=8)
        return (int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)) or 1

    def _ready(self, what):
        if self.client is None:
            raise RuntimeError("kvside: %s before register_mem_pool_host" % what)

    # -- the v1 (zero-copy) interface: the KV pool

    def batch_exists(self, keys, extra_info=None):
        """How many leading pages are stored on every rank of this world (a
        kvside lookup: L1 or L2). The hit is pinned in L1 for pin_ms and L2
        hits start moving to L1, so the get that follows finds them."""
        self._ready("batch_exists")
        kk = self._v1_keys(keys)
        if not kk:
            return 0
        self.stats["exists_calls"] += 1
        try:
            hits = self._lookup(self.regs[KV], kk)
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
        kk = self._v1_keys(keys)
        pages = self._pages(len(kk), host_indices)
        n = len(kk)
        if not n:
            return []
        self.stats["gets"] += 1
        got = self._get(self.regs[KV], kk, pages)
        self.stats["get_pages"] += got
        self.stats["get_failed_pages"] += n - got
        return [i < got for i in range(n)]

    def _lookup(self, reg, kk, quiet=False):
        if quiet:
            return reg.client.lookup(kk, timeout_ms=self.cfg.lookup_timeout_ms).hits
        return reg.client.lookup(kk, prefetch=self.cfg.prefetch, pin_ms=self.cfg.pin_ms,
                                 timeout_ms=self.cfg.lookup_timeout_ms).hits

    def _lookup_quiet(self, reg, kk):
        try:
            return self._lookup(reg, kk, quiet=True)
        except kvside.KvsideError:
            return 0

    def _get(self, reg, kk, pages):
        """Pages of an attention group into place (≤ MAX_KEYS): how many
        leading ones. On a miss (evicted since the lookup, or another rank's
        part refused) fetches what every rank still has, once."""
        got = self._retrieve(reg, kk, pages)
        if got < len(kk):
            h = self._lookup_quiet(reg, kk)
            got = h if h and self._retrieve(reg, kk[:h], pages[:h]) == h else 0
        return got

    def _retrieve(self, reg, kk, pages):
        """One retrieve job of these pages: len(kk) if the bytes are in place,
        else 0. A part's reply comes once this rank's copies ended, so the
        rank does not wait for the others (their parts commit the job)."""
        job = self._job("get", kk + pages, reg)
        c = reg.client
        reconnects = c.reconnects
        try:
            p = c.retrieve_async(job, b"".join(kk), [pages], timeout_ms=self.cfg.load_timeout_ms)
            c.complete_async(job, True, timeout_ms=self.cfg.load_timeout_ms)
            state = p.result(self.cfg.load_timeout_ms / 1000.0 + 1.0)
        except kvside.KvsideError as e:
            if e.code_name != "E_MISS":
                log.warning("kvside: get of %d pages of pool %r failed (%s)", len(kk), reg.name, e)
            if e.code_name in ("ETIMEDOUT", "E_TIMEOUT"):
                # the server may still write into the pages (a slow L2
                # promotion): SGLang may reuse them only once the job ended
                self._wait_end(reg, job, reconnects)
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
        kk = self._v1_keys(keys)
        pages = self._pages(len(kk), host_indices)
        n = len(kk)
        if not n:
            return []
        self.stats["sets"] += 1
        ok = self._store(self.regs[KV], kk, pages)
        self.stats["set_pages" if ok else "set_failed_pages"] += n
        return [ok] * n

    def _store(self, reg, kk, pages):
        # the id covers the keys, not the host pages: ranks hold the same
        # pages in different slots only if their pools diverged, and then the
        # job still has one id (the part digests differ per rank, not per job)
        job = self._job("set", kk, reg)
        c = reg.client
        reconnects = c.reconnects
        try:
            # one message per rank and job (protocol.md 6.7): the part
            # carries this rank's complete and is answered when the job
            # ends, so it waits as long as a store may (store_wait_ms)
            p = c.store_complete_async(job, b"".join(kk), [pages], timeout_ms=self.cfg.store_wait_ms)
            self.stats["set_messages"] += 1
            p.result(self.cfg.store_wait_ms / 1000.0 + 1.0)
        except kvside.KvsideError as e:
            if e.code_name == "E_JOB_CONFLICT":
                log.warning("kvside: set of %d pages of pool %r refused: another rank sent other pages under "
                            "the same job (the TP ranks' calls diverged)", len(kk), reg.name)
            else:
                log.warning("kvside: set of %d pages of pool %r failed (%s)", len(kk), reg.name, e)
            # a time-out is the job not ending within store_wait_ms (the
            # part's reply waits for its end): where _wait_end gives up too,
            # so it is not waited for a second time
            return False
        return self._wait_end(reg, job, reconnects) == "committed"

    def _wait_end(self, reg, job, reconnects):
        deadline = time.monotonic() + self.cfg.store_wait_ms / 1000.0
        c = reg.client
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

    # -- the hybrid (v2) interface: SGLang's HybridCacheController

    def _transfer(self, t, what):
        """(reg, name, keys) of a PoolTransfer; keys may be None."""
        name = _name(getattr(t, "name", None))
        reg = self.regs.get(name)
        if reg is None:
            raise ValueError("kvside: %s names host pool %r, which is not registered (register_mem_host_pool_v2; "
                             "registered: %s)" % (what, name, ", ".join(sorted(self.regs)) or "none"))
        keys = getattr(t, "keys", None)
        return reg, name, keys

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """The usable prefix of keys (SGLang's page hashes): the longest n
        such that the KV pages 0..n-1 are stored and every pool of
        pool_transfers holds what its hit policy needs for a prefix of n
        pages ("all_pages": pages 0..n-1; "trailing_pages": the last
        len(transfer.keys) pages, a Mamba state: the state at the end of page
        n-1), each on every TP rank of its world. Returns SGLang's
        PoolTransferResult: kv_hit_pages = that n, extra_pool_hit_pages =
        each pool's own longest prefix (as SGLang's file backend reports)."""
        self._ready("batch_exists_v2")
        kv = self.regs[KV]
        kk = self._keys(keys)
        rules = []
        for t in pool_transfers or []:
            reg, name, tkeys = self._transfer(t, "batch_exists_v2")
            if tkeys is not None and (isinstance(tkeys, (str, bytes)) or not hasattr(tkeys, "__len__")):
                raise TypeError("kvside: pool %r: transfer keys must be a list of page hashes" % name)
            policy = _policy(getattr(t, "hit_policy", ALL_PAGES))
            window = max(1, len(tkeys) if tkeys else 1)
            if reg.kind == "recurrent" and policy != TRAILING_PAGES:
                raise ValueError("kvside: pool %r holds one state per prefix end (a kvside recurrent group): its "
                                 "hit policy must be trailing_pages, not %s" % (name, policy))
            rules.append((reg, t.name, policy, window, kk if reg is kv else self._keys(keys, reg)))
        if not kk:
            return PoolTransferResult(0, {})
        self.stats["v2_exists_calls"] += 1
        try:
            kv_pages = self._run(kv, kk, 0, len(kk))
            hit_count = {KV: kv_pages} if kv_pages else {}
            final, holds = kv_pages, []
            for reg, name, policy, window, pk in rules:
                b = self._boundary(reg, policy, window, pk, kv_pages)
                if b:
                    hit_count[name] = b
                final = min(final, b)
                holds.append(b)   # the rule holds at exactly this length
            # every pool's rule at one common length: the largest n ≤ final
            # that satisfies them all (a trailing window shifts with n)
            changed = True
            while changed and final > 0:
                changed = False
                for i, (reg, name, policy, window, pk) in enumerate(rules):
                    if holds[i] == final:
                        continue
                    holds[i] = b = self._boundary(reg, policy, window, pk, final)
                    if b < final:
                        final, changed = b, True
        except kvside.KvsideError as e:
            log.warning("kvside: lookup of %d pages (hybrid) failed (%s): no hit", len(kk), e)
            return PoolTransferResult(0, {})
        return PoolTransferResult(final, hit_count)

    def _run(self, reg, kk, start, end):
        """Length of the leading run of kk[start:end] stored (attention
        group), in lookups of at most MAX_KEYS keys."""
        total = 0
        for s in range(start, end, MAX_KEYS):
            e = min(end, s + MAX_KEYS)
            h = self._lookup(reg, kk[s:e])
            total += h
            if h < e - s:
                break
        return total

    def _last_state(self, reg, kk, p):
        """Recurrent group: the largest n ≤ p whose state (after page n-1) is
        stored, 0 if none (one lookup per MAX_KEYS keys, from the end)."""
        e = p
        while e > 0:
            s = max(0, e - MAX_KEYS)
            h = self._lookup(reg, kk[s:e])
            if h:
                return s + h
            e = s
        return 0

    def _boundary(self, reg, policy, window, kk, p):
        """The largest n ≤ p for which this pool holds what a prefix of n
        pages needs under its hit policy."""
        if p <= 0:
            return 0
        if policy == ALL_PAGES:
            return self._run(reg, kk, 0, p)
        if reg.kind == "recurrent":
            while p > 0:
                n = self._last_state(reg, kk, p)
                if n <= 1 or window == 1:
                    return n
                # the other states of the window, each its own lookup
                missing = [i for i in range(max(0, n - window), n - 1) if not self._lookup(reg, [kk[i]])]
                if not missing:
                    return n
                p = missing[0]
            return 0
        # attention group: the trailing window ending at n; a window that
        # lacks page m rules out every n > m (up to p)
        for _ in range(_TRAILING_STEPS):
            if p <= 0:
                return 0
            s = max(0, p - window)
            h = self._run(reg, kk, s, p)
            if h == p - s:
                return p
            p = s + h
        self.stats["trailing_search_capped"] += 1
        log.info("kvside: trailing-window search of pool %r stopped after %d lookups (answering no hit)",
                 reg.name, _TRAILING_STEPS)
        return 0

    def batch_get_v2(self, transfers, extra_info=None):
        """Copies each transfer's pages (keys[i] into the pool page
        host_indices names for it) from the server: {pool name: [bool] per
        key}, True only for pages whose bytes are in place (a leading run).
        A Mamba transfer gets each key's state into its slot."""
        self._ready("batch_get_v2")
        work = [self._prepare(t, "batch_get_v2") for t in transfers or []]
        results = {}
        for reg, name, kk, pages in work:
            n = len(kk)
            got = 0
            if n:
                self.stats["v2_gets"] += 1
                if reg.kind == "recurrent":
                    # a retrieve writes only the last chunk's state: one job per state
                    for k, p in zip(kk, pages):
                        if self._retrieve(reg, [k], [p]) != 1:
                            break
                        got += 1
                else:
                    for s in range(0, n, MAX_KEYS):
                        e = min(n, s + MAX_KEYS)
                        g = self._get(reg, kk[s:e], pages[s:e])
                        got += g
                        if g < e - s:
                            break
            self.stats["v2_get_pages"] += got
            self.stats["v2_get_failed_pages"] += n - got
            results.setdefault(self._key_of(transfers, name), []).extend(i < got for i in range(n))
        return results

    @staticmethod
    def _key_of(transfers, name):
        # results are keyed by the transfer's own name object (SGLang's
        # PoolName), as SGLang's backends key them
        for t in transfers:
            if _name(t.name) == name:
                return t.name
        return name

    def _prepare(self, t, what):
        reg, name, tkeys = self._transfer(t, what)
        if tkeys is None:
            raise ValueError("kvside: %s: the transfer of pool %r has no keys (SGLang resolves a KV-derived "
                             "pool's keys and indices before calling)" % (what, name))
        kk = self._keys(tkeys, reg)
        hi = getattr(t, "host_indices", None)
        if hi is None:
            raise ValueError("kvside: %s: the transfer of pool %r has no host_indices" % (what, name))
        return reg, name, kk, self._pages(len(kk), hi, reg)

    def batch_set_v2(self, transfers, extra_info=None):
        """Stores each transfer's pages under its keys: one job per pool (per
        MAX_KEYS keys) spanning the pool's world, waited for like
        batch_set_v1: {pool name: [bool] per key}, all True for a job that
        committed. A Mamba transfer stores each slot as the state at the end
        of its key's page."""
        self._ready("batch_set_v2")
        work = [self._prepare(t, "batch_set_v2") for t in transfers or []]
        results = {}
        for reg, name, kk, pages in work:
            n = len(kk)
            out = []
            if n:
                self.stats["v2_sets"] += 1
            for s in range(0, n, MAX_KEYS):
                e = min(n, s + MAX_KEYS)
                ok = self._store(reg, kk[s:e], pages[s:e])
                out += [ok] * (e - s)
                self.stats["v2_set_pages" if ok else "v2_set_failed_pages"] += e - s
            results.setdefault(self._key_of(transfers, name), []).extend(out)
        return results

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

    # -- housekeeping

    def clear(self):
        """Not forwarded: kvside's clear drops every engine's objects
        (kvside-ctl clear does that on purpose)."""
        log.info("kvside: clear() ignored; use kvside-ctl clear to drop the server's whole cache")

    def get_stats(self):
        return None
