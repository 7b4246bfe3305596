"""kvside.sglang.storage: KvsideStorage, the HiCacheStorage of SGLang's
hierarchical cache over kvside-server: registration of the rank's host
pools, the zero-copy v1 interface, the jobs behind both interfaces (the v2
calls are in hybrid.py). See the package's docstring for how it maps."""

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch

import kvside
from kvside import layout as _layout
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from . import hybrid as _hybrid
from .config import _LRU, MAX_KEYS, StorageConfig
from .hybrid import _REFUSED_PREFIX, KV, MAMBA, _name
from .pools import _dtype_name, namespace_of, page_key, pool_views

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

log = logging.getLogger("kvside.sglang")


def _agree_nonce(need: bool) -> str:
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
        obj: List[Optional[str]] = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        if not isinstance(obj[0], str):
            raise RuntimeError("kvside: the TP ranks' job-id nonce did not arrive from rank 0")
        return obj[0]
    if need:
        raise RuntimeError("kvside: torch.distributed is not initialized, so the TP ranks cannot agree "
                           "on job ids (SGLang initialises it before the hierarchical cache)")
    return os.urandom(8).hex()


class _Reg:
    """One kvside registration: a host pool of this rank as one group of one
    kvside session (KV, or one of SGLang's hybrid side pools)."""

    __slots__ = ("name", "pool", "kind", "replicated", "world", "rank", "engine", "namespace", "ns_digest",
                 "client", "handle", "num_pages", "page_size", "views", "reconnects")

    name: str
    pool: Any                      # SGLang's host pool
    kind: str                      # "attention" or "recurrent" (kvside's group kind)
    replicated: bool               # the same bytes on every TP rank (MLA): a world of one
    world: int
    rank: int
    engine: str
    namespace: str
    ns_digest: bytes
    client: Optional[kvside.Client]  # set by KvsideStorage._register, None once closed
    handle: Optional[int]
    num_pages: int
    page_size: int
    views: List[_layout.View]
    reconnects: int

    def __init__(self, name: str, pool: Any, kind: str, replicated: bool) -> None:
        self.name, self.pool, self.kind, self.replicated = name, pool, kind, replicated
        self.client, self.handle = None, None
        self.namespace, self.ns_digest, self.engine = "", b"", ""
        self.num_pages = self.page_size = 0
        self.world, self.rank, self.views, self.reconnects = 1, 0, [], 0

    def session(self) -> kvside.Client:
        """The registration's client (there is one from its registration on)."""
        if self.client is None:
            raise RuntimeError("kvside: host pool %r is not registered (or the backend was closed)" % self.name)
        return self.client


class KvsideStorage(HiCacheStorage):
    """SGLang HiCache storage backend over kvside-server (one per TP rank).

    Constructed by SGLang's StorageBackendFactory as
    ``KvsideStorage(storage_config, kwargs)``; the KV pool arrives through
    ``register_mem_pool_host``, a hybrid model's side pools (Mamba states,
    SWA, DSA indexer, draft) through ``register_mem_host_pool_v2``: each pool
    is its own kvside registration (docs/sglang.md, "Hybrid models").
    Runtime failures (server down, misses, time-outs) are reported as misses
    / failed pages and logged; bad input raises ValueError or TypeError."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
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
        # the KV registration's, for callers of the single-pool API
        self.client: Optional[kvside.Client] = None
        self.handle: Optional[int] = None
        self.namespace: Optional[str] = None
        self._ns_digest: Optional[bytes] = None
        self.num_pages = 0
        self.mem_pool_host: Any = None  # SGLang's KV host pool (HiCacheStorage.register_mem_pool_host sets it)
        self.regs: Dict[str, _Reg] = {}  # pool name -> _Reg ("kv" once register_mem_pool_host ran)
        self._lock = threading.Lock()
        self._reg_lock = threading.Lock()
        self._occ: Dict[Tuple[str, str], "OrderedDict[bytes, int]"] = {}  # (pool, op) -> digest -> runs
        self.stats = {"exists_calls": 0, "exists_hits": 0, "gets": 0, "get_pages": 0, "get_failed_pages": 0,
                      "sets": 0, "set_pages": 0, "set_failed_pages": 0, "jobs_deadline": 0,
                      "reconnects": 0, "v2_exists_calls": 0, "v2_gets": 0, "v2_get_pages": 0,
                      "v2_get_failed_pages": 0, "v2_sets": 0, "v2_set_pages": 0, "v2_set_failed_pages": 0,
                      "trailing_search_capped": 0, "set_messages": 0}
        self._warned = 0.0

    # -- registration

    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
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

    def register_mem_host_pool_v2(self, host_pool: "HostKVCache", host_pool_name: Any) -> None:
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

    def _register(self, reg: _Reg) -> None:
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
        allocs: List[Any] = []
        by_inode: Dict[int, int] = {}
        layers: List[kvside.Layer] = []
        try:
            for j, v in enumerate(views):
                layers.append(_layout.view_layer(allocs, by_inode, 0, v, num_pages, "%s (view %d)" % (what, j)))
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

    def _namespace(self, reg: _Reg, views: List[_layout.View]) -> str:
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

    def close(self) -> None:
        for reg in set(self.regs.values()):
            if reg.client is not None:
                reg.client.close()
                reg.client = None
        self.client = None

    def _on_event_of(self, reg: _Reg) -> Callable[[kvside.Event], None]:
        def on_event(ev: kvside.Event) -> None:
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

    def _keys(self, keys: Sequence[str], reg: Optional[_Reg] = None) -> List[bytes]:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError("kvside: keys must be a list of SGLang page hashes (strings)")
        digest = (reg or self.regs[KV]).ns_digest
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError("kvside: a page hash must be a non-empty string, not %r" % (k,))
            out.append(page_key(digest, k))
        return out

    def _v1_keys(self, keys: Sequence[str]) -> List[bytes]:
        if not isinstance(keys, (str, bytes)) and hasattr(keys, "__len__") and len(keys) > MAX_KEYS:
            raise ValueError("kvside: %d keys in one call exceed kvside's %d" % (len(keys), MAX_KEYS))
        return self._keys(keys)

    def _pages(self, n: int, host_indices: Any, reg: Optional[_Reg] = None) -> List[int]:
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

    def _job(self, op: str, parts: Sequence[Any], reg: Optional[_Reg] = None) -> int:
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

    def _ready(self, what: str) -> None:
        if self.client is None:
            raise RuntimeError("kvside: %s before register_mem_pool_host" % what)

    # -- the v1 (zero-copy) interface: the KV pool

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
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

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
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

    def _lookup(self, reg: _Reg, kk: List[bytes], quiet: bool = False) -> int:
        if quiet:
            return reg.session().lookup(kk, timeout_ms=self.cfg.lookup_timeout_ms).hits
        return reg.session().lookup(kk, prefetch=self.cfg.prefetch, pin_ms=self.cfg.pin_ms,
                                 timeout_ms=self.cfg.lookup_timeout_ms).hits

    def _lookup_quiet(self, reg: _Reg, kk: List[bytes]) -> int:
        try:
            return self._lookup(reg, kk, quiet=True)
        except kvside.KvsideError:
            return 0

    def _get(self, reg: _Reg, kk: List[bytes], pages: List[int]) -> int:
        """Pages of an attention group into place (≤ MAX_KEYS): how many
        leading ones. On a miss (evicted since the lookup, or another rank's
        part refused) fetches what every rank still has, once."""
        got = self._retrieve(reg, kk, pages)
        if got < len(kk):
            h = self._lookup_quiet(reg, kk)
            got = h if h and self._retrieve(reg, kk[:h], pages[:h]) == h else 0
        return got

    def _retrieve(self, reg: _Reg, kk: List[bytes], pages: List[int]) -> int:
        """One retrieve job of these pages: len(kk) if the bytes are in place,
        else 0. A part's reply comes once this rank's copies ended, so the
        rank does not wait for the others (their parts commit the job)."""
        job = self._job("get", kk + pages, reg)
        c = reg.session()
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

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
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

    def _store(self, reg: _Reg, kk: List[bytes], pages: List[int]) -> bool:
        # the id covers the keys, not the host pages: ranks hold the same
        # pages in different slots only if their pools diverged, and then the
        # job still has one id (the part digests differ per rank, not per job)
        job = self._job("set", kk, reg)
        c = reg.session()
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

    def _wait_end(self, reg: _Reg, job: int, reconnects: int) -> Optional[str]:
        deadline = time.monotonic() + self.cfg.store_wait_ms / 1000.0
        c = reg.session()
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

    # -- the hybrid (v2) interface: SGLang's HybridCacheController (hybrid.py)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Any:
        """The usable prefix of keys for KV and every pool of pool_transfers
        at once (hybrid.exists_v2): SGLang's PoolTransferResult."""
        return _hybrid.exists_v2(self, keys, pool_transfers)

    def batch_get_v2(self, transfers: List[Any],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[Any, List[bool]]:
        """Each transfer's pages from the server (hybrid.get_v2)."""
        return _hybrid.get_v2(self, transfers)

    def batch_set_v2(self, transfers: List[Any],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[Any, List[bool]]:
        """Each transfer's pages stored under its keys (hybrid.set_v2)."""
        return _hybrid.set_v2(self, transfers)

    # -- the non-zero-copy interface (SGLang uses it only without interface_v1)

    def _no_copy_path(self) -> NoReturn:
        raise NotImplementedError("kvside: only SGLang's zero-copy interface is supported; set "
                                  "\"interface_v1\": 1 in --hicache-storage-backend-extra-config")

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        self._no_copy_path()

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        self._no_copy_path()

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        self._no_copy_path()

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        self._no_copy_path()

    # -- housekeeping

    def clear(self) -> None:
        """Not forwarded: kvside's clear drops every engine's objects
        (kvside-ctl clear does that on purpose)."""
        log.info("kvside: clear() ignored; use kvside-ctl clear to drop the server's whole cache")

    def get_stats(self) -> None:
        return None
