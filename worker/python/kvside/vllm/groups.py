"""vLLM KV-cache groups as kvside groups, and block lists in kvside's shape.

vLLM gives one block table per KV-cache group (``kv_cache_config.
kv_cache_groups``); kvside takes one block list per group with
``len(keys) * blocks_per_chunk`` ids (protocol.md 10). One kvside group per
vLLM group kvside keeps, with the vLLM group's index as its id. Specs are
told apart by ``isinstance`` against vLLM's own classes (a
``UniformTypeKVCacheSpecs`` by the one kind of its members):

| vLLM spec | kvside group |
|---|---|
| FullAttentionSpec, MLAAttentionSpec (exactly these classes) | attention, full |
| SlidingWindowSpec, SlidingWindowMLASpec (window W tokens) | attention, window ceil((W-1)/chunk) chunks |
| MambaSpec ("align" mode) | recurrent: the state after the chunk's last token |
| a group vLLM keeps out of hash-addressed stores (``prefix_cacheable_group_ids``: CircularBufferSpec rings, HiSparse caches, ``enable_kv_transfer=False``) | none: neither stored nor loaded |
| anything else (ChunkedLocalAttentionSpec, RSWASpec, SinkFullAttentionSpec, HiddenStateCacheSpec, a spec of a later vLLM) | refused at start, naming the class |

The refused ones free or rewrite blocks while a request runs in ways kvside's
chunks cannot describe (RSWA evicts gap blocks every decode step; chunked
local attention keeps only the current local chunk), or hold something other
than a prefix's KV; treating them as full attention would store recycled
bytes. vLLM's null block is id 0 in every group (``BlockPool.null_block``).
"""

from collections import namedtuple

NULL = 0

GroupInfo = namedtuple("GroupInfo", "index kind block_size blocks_per_chunk window_chunks")
GroupInfo.__doc__ = ("index: the vLLM group (and kvside group id); kind: 'full', 'window' or "
                     "'recurrent'; window_chunks -1 unless 'window'.")

_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW = ("SlidingWindowSpec", "SlidingWindowMLASpec")


def _classes(names):
    from vllm.v1 import kv_cache_interface as K
    return tuple(c for c in (getattr(K, n, None) for n in names) if c is not None)


def _kind(spec, gi):
    """('full' | 'window' | 'recurrent', sliding window tokens or 0)."""
    from vllm.v1 import kv_cache_interface as K
    uniform = getattr(K, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        kinds = {_kind(s, gi) for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise ValueError("kvside: KV-cache group %d mixes layer kinds %s" % (gi, sorted(kinds)))
        return kinds.pop()
    mamba = getattr(K, "MambaSpec", None)
    if mamba is not None and isinstance(spec, mamba):
        mode = getattr(spec, "mamba_cache_mode", "align")
        if mode not in ("align", "all"):
            raise ValueError("kvside: KV-cache group %d is Mamba state with mamba_cache_mode %r; "
                             "kvside needs prefix caching on (mode 'align')" % (gi, mode))
        return "recurrent", 0
    if type(spec) in _classes(_FULL):
        return "full", 0
    if type(spec) in _classes(_WINDOW):
        return "window", int(spec.sliding_window)
    raise ValueError("kvside: KV-cache group %d has a %s, which kvside cannot store (it keeps full "
                     "attention, sliding-window attention and Mamba state: %s, %s, MambaSpec)"
                     % (gi, type(spec).__name__, ", ".join(_FULL), ", ".join(_WINDOW)))


def group_infos(kv_cache_config, chunk_tokens):
    """GroupInfo per vLLM group kvside keeps (in vLLM's order), or
    ValueError when a group cannot be kept or chunk_tokens does not suit a
    group (it must be a multiple of every kept group's block size)."""
    keep = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    out = []
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        if keep is not None and gi not in keep:
            continue
        spec = g.kv_cache_spec
        kind, w = _kind(spec, gi)
        bs = int(spec.block_size)
        if bs <= 0 or chunk_tokens % bs:
            raise ValueError("kvside: chunk_tokens %d is not a multiple of KV-cache group %d's block "
                             "size %d" % (chunk_tokens, gi, bs))
        window = max(1, -(-(w - 1) // chunk_tokens)) if kind == "window" else -1
        out.append(GroupInfo(gi, kind, bs, chunk_tokens // bs, window))
    if not out:
        raise ValueError("kvside: no KV-cache group of this model can be stored")
    return out


def kvside_groups(infos):
    """kvside.Group objects for a registration."""
    import kvside
    return [kvside.Group(g.index, "recurrent" if g.kind == "recurrent" else "attention", g.block_size,
                         g.blocks_per_chunk, g.window_chunks, NULL) for g in infos]


def chunk_ids(table, g, first_chunk, n_chunks, store):
    """The block ids of chunks [first_chunk, first_chunk + n_chunks) of one
    group's block table, in kvside's shape (blocks_per_chunk ids per chunk).

    Entries past the table are null. For an attention group a chunk with a
    null block is all null (nothing to store; a retrieve does not need it).
    For a recurrent group only the chunk's last slot can carry a state (the
    state after the chunk's last token, vLLM "align" mode): the other slots
    are null; for a retrieve only the last chunk keeps it."""
    bpc = g.blocks_per_chunk
    out = []
    for c in range(first_chunk, first_chunk + n_chunks):
        ids = [table[i] if i < len(table) else NULL for i in range(c * bpc, (c + 1) * bpc)]
        if g.kind == "recurrent":
            last = ids[-1]
            keep = store or c == first_chunk + n_chunks - 1
            ids = [NULL] * (bpc - 1) + [last if keep else NULL]
        elif store and NULL in ids:
            ids = [NULL] * bpc
        out.extend(ids)
    return out


def has_blocks(ids):
    return any(i != NULL for i in ids)
