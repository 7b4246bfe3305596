"""kvside.sglang.pools: an SGLang host pool as kvside layer views, the
namespace of a model's pages and their keys (docs/sglang.md, "How it maps")."""

import hashlib
from typing import Any, List, Tuple

from kvside import layout as _layout

from .config import StorageConfig

def pool_views(pool: Any, name: str = "kv") -> Tuple[List[_layout.View], int]:
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

    def meta(p: int) -> Tuple[List[int], List[int]]:
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


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def namespace_of(cfg: StorageConfig, storage_config: Any, pool: Any, views: List[_layout.View]) -> str:
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


def page_key(ns_digest: bytes, page_hash: str) -> bytes:
    """The 32-byte kvside key of an SGLang page hash (a string: SGLang's page
    hashes chain the whole prefix, and whatever SGLang mixes into them)."""
    return hashlib.blake2b(page_hash.encode(), digest_size=32, key=ns_digest, person=b"kvside-sglang").digest()
