"""kvside.sglang.hybrid: SGLang's v2 interface for hybrid models
(HybridCacheController: register_mem_host_pool_v2, batch_exists_v2 /
batch_get_v2 / batch_set_v2 with PoolTransfers). Every side pool is a
registration of its own; batch_exists_v2 answers the longest prefix that KV
and every pool's hit policy allow at once (docs/sglang.md, "Hybrid models").
The functions take the KvsideStorage (st) whose methods they are."""

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import kvside

from .config import MAX_KEYS

if TYPE_CHECKING:
    from .storage import KvsideStorage, _Reg

log = logging.getLogger("kvside.sglang")

MAMBA = "mamba"
KV = "kv"
# SGLang's DeepSeek V4 pools (PoolName.DEEPSEEK_V4_*): refused, docs/sglang.md says why
_REFUSED_PREFIX = "deepseek_v4"
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"
_TRAILING_STEPS = 64     # lookups one trailing-window search of an attention pool may take


def _name(x: Any) -> str:
    """A pool name as a plain string (SGLang's PoolName is a str Enum whose
    str() is its value)."""
    v = getattr(x, "value", x)
    if not isinstance(v, str) or not v:
        raise TypeError("kvside: a pool name must be a non-empty string (SGLang's PoolName), not %r" % (x,))
    return v


def _policy(p: Any) -> str:
    v = getattr(p, "value", p)
    if v not in (ALL_PAGES, TRAILING_PAGES):
        raise ValueError("kvside: unknown pool hit policy %r (SGLang's PoolHitPolicy: all_pages, "
                         "trailing_pages)" % (p,))
    return v


try:  # SGLang at 001067ff defines it next to HiCacheStorage; batch_exists_v2 answers it
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
except ImportError:  # pragma: no cover - an SGLang without the v2 interface never calls it
    class PoolTransferResult:  # type: ignore[no-redef]
        def __init__(self, kv_hit_pages, extra_pool_hit_pages):
            self.kv_hit_pages, self.extra_pool_hit_pages = kv_hit_pages, extra_pool_hit_pages


def transfer(st: "KvsideStorage", t: Any, what: str) -> Tuple["_Reg", str, Optional[Sequence[str]]]:
    """(reg, name, keys) of a PoolTransfer; keys may be None."""
    name = _name(getattr(t, "name", None))
    reg = st.regs.get(name)
    if reg is None:
        raise ValueError("kvside: %s names host pool %r, which is not registered (register_mem_host_pool_v2; "
                         "registered: %s)" % (what, name, ", ".join(sorted(st.regs)) or "none"))
    keys = getattr(t, "keys", None)
    return reg, name, keys


def exists_v2(st: "KvsideStorage", keys: List[str], pool_transfers: Optional[List[Any]]) -> PoolTransferResult:
    """The usable prefix of keys (SGLang's page hashes): the longest n
    such that the KV pages 0..n-1 are stored and every pool of
    pool_transfers holds what its hit policy needs for a prefix of n
    pages ("all_pages": pages 0..n-1; "trailing_pages": the last
    len(transfer.keys) pages, a Mamba state: the state at the end of page
    n-1), each on every TP rank of its world. Returns SGLang's
    PoolTransferResult: kv_hit_pages = that n, extra_pool_hit_pages =
    each pool's own longest prefix (as SGLang's file backend reports)."""
    st._ready("batch_exists_v2")
    kv = st.regs[KV]
    kk = st._keys(keys)
    rules = []
    for t in pool_transfers or []:
        reg, name, tkeys = transfer(st, t, "batch_exists_v2")
        if tkeys is not None and (isinstance(tkeys, (str, bytes)) or not hasattr(tkeys, "__len__")):
            raise TypeError("kvside: pool %r: transfer keys must be a list of page hashes" % name)
        policy = _policy(getattr(t, "hit_policy", ALL_PAGES))
        window = max(1, len(tkeys) if tkeys else 1)
        if reg.kind == "recurrent" and policy != TRAILING_PAGES:
            raise ValueError("kvside: pool %r holds one state per prefix end (a kvside recurrent group): its "
                             "hit policy must be trailing_pages, not %s" % (name, policy))
        rules.append((reg, t.name, policy, window, kk if reg is kv else st._keys(keys, reg)))
    if not kk:
        return PoolTransferResult(0, {})
    st.stats["v2_exists_calls"] += 1
    try:
        kv_pages = run(st, kv, kk, 0, len(kk))
        hit_count = {KV: kv_pages} if kv_pages else {}
        final, holds = kv_pages, []
        for reg, name, policy, window, pk in rules:
            b = boundary(st, reg, policy, window, pk, kv_pages)
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
                holds[i] = b = boundary(st, reg, policy, window, pk, final)
                if b < final:
                    final, changed = b, True
    except kvside.KvsideError as e:
        log.warning("kvside: lookup of %d pages (hybrid) failed (%s): no hit", len(kk), e)
        return PoolTransferResult(0, {})
    return PoolTransferResult(final, hit_count)


def run(st: "KvsideStorage", reg: "_Reg", kk: List[bytes], start: int, end: int) -> int:
    """Length of the leading run of kk[start:end] stored (attention
    group), in lookups of at most MAX_KEYS keys."""
    total = 0
    for s in range(start, end, MAX_KEYS):
        e = min(end, s + MAX_KEYS)
        h = st._lookup(reg, kk[s:e])
        total += h
        if h < e - s:
            break
    return total


def last_state(st: "KvsideStorage", reg: "_Reg", kk: List[bytes], p: int) -> int:
    """Recurrent group: the largest n ≤ p whose state (after page n-1) is
    stored, 0 if none (one lookup per MAX_KEYS keys, from the end)."""
    e = p
    while e > 0:
        s = max(0, e - MAX_KEYS)
        h = st._lookup(reg, kk[s:e])
        if h:
            return s + h
        e = s
    return 0


def boundary(st: "KvsideStorage", reg: "_Reg", policy: str, window: int, kk: List[bytes], p: int) -> int:
    """The largest n ≤ p for which this pool holds what a prefix of n
    pages needs under its hit policy."""
    if p <= 0:
        return 0
    if policy == ALL_PAGES:
        return run(st, reg, kk, 0, p)
    if reg.kind == "recurrent":
        while p > 0:
            n = last_state(st, reg, kk, p)
            if n <= 1 or window == 1:
                return n
            # the other states of the window, each its own lookup
            missing = [i for i in range(max(0, n - window), n - 1) if not st._lookup(reg, [kk[i]])]
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
        h = run(st, reg, kk, s, p)
        if h == p - s:
            return p
        p = s + h
    st.stats["trailing_search_capped"] += 1
    log.info("kvside: trailing-window search of pool %r stopped after %d lookups (answering no hit)",
             reg.name, _TRAILING_STEPS)
    return 0


def get_v2(st: "KvsideStorage", transfers: List[Any]) -> Dict[Any, List[bool]]:
    """Copies each transfer's pages (keys[i] into the pool page
    host_indices names for it) from the server: {pool name: [bool] per
    key}, True only for pages whose bytes are in place (a leading run).
    A Mamba transfer gets each key's state into its slot."""
    st._ready("batch_get_v2")
    work = [prepare(st, t, "batch_get_v2") for t in transfers or []]
    results: Dict[Any, List[bool]] = {}
    for reg, name, kk, pages in work:
        n = len(kk)
        got = 0
        if n:
            st.stats["v2_gets"] += 1
            if reg.kind == "recurrent":
                # a retrieve writes only the last chunk's state: one job per state
                for k, p in zip(kk, pages):
                    if st._retrieve(reg, [k], [p]) != 1:
                        break
                    got += 1
            else:
                for s in range(0, n, MAX_KEYS):
                    e = min(n, s + MAX_KEYS)
                    g = st._get(reg, kk[s:e], pages[s:e])
                    got += g
                    if g < e - s:
                        break
        st.stats["v2_get_pages"] += got
        st.stats["v2_get_failed_pages"] += n - got
        results.setdefault(key_of(transfers, name), []).extend(i < got for i in range(n))
    return results


def key_of(transfers: List[Any], name: str) -> Any:
    # results are keyed by the transfer's own name object (SGLang's
    # PoolName), as SGLang's backends key them
    for t in transfers:
        if _name(t.name) == name:
            return t.name
    return name


def prepare(st: "KvsideStorage", t: Any, what: str) -> Tuple["_Reg", str, List[bytes], List[int]]:
    reg, name, tkeys = transfer(st, t, what)
    if tkeys is None:
        raise ValueError("kvside: %s: the transfer of pool %r has no keys (SGLang resolves a KV-derived "
                         "pool's keys and indices before calling)" % (what, name))
    kk = st._keys(tkeys, reg)
    hi = getattr(t, "host_indices", None)
    if hi is None:
        raise ValueError("kvside: %s: the transfer of pool %r has no host_indices" % (what, name))
    return reg, name, kk, st._pages(len(kk), hi, reg)


def set_v2(st: "KvsideStorage", transfers: List[Any]) -> Dict[Any, List[bool]]:
    """Stores each transfer's pages under its keys: one job per pool (per
    MAX_KEYS keys) spanning the pool's world, waited for like
    batch_set_v1: {pool name: [bool] per key}, all True for a job that
    committed. A Mamba transfer stores each slot as the state at the end
    of its key's page."""
    st._ready("batch_set_v2")
    work = [prepare(st, t, "batch_set_v2") for t in transfers or []]
    results: Dict[Any, List[bool]] = {}
    for reg, name, kk, pages in work:
        n = len(kk)
        out = []
        if n:
            st.stats["v2_sets"] += 1
        for s in range(0, n, MAX_KEYS):
            e = min(n, s + MAX_KEYS)
            ok = st._store(reg, kk[s:e], pages[s:e])
            out += [ok] * (e - s)
            st.stats["v2_set_pages" if ok else "v2_set_failed_pages"] += e - s
        results.setdefault(key_of(transfers, name), []).extend(out)
    return results
