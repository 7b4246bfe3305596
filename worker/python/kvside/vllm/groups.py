"""vLLM KV-cache groups as kvside groups, and block lists in kvside's shape.

vLLM gives one block table per KV-cache group (``kv_cache_config.
kv_cache_groups``); kvside takes one block list per group with
``len(keys) * blocks_per_chunk`` ids (protocol.md 10). One kvside group per
vLLM group, same index:

| vLLM spec | kvside group |
|---|---|
| FullAttentionSpec, MLAAttentionSpec (and other full specs) | attention, full |
| SlidingWindowSpec (window W tokens) | attention, window ceil((W-1)/chunk) chunks |
| MambaSpec ("align" mode) | recurrent: the state after the chunk's last token |

vLLM's null block is id 0 in every group (``BlockPool.null_block``).
"""

from collections import namedtuple

NULL = 0

GroupInfo = namedtuple("GroupInfo", "index kind block_size blocks_per_chunk window_chunks")
GroupInfo.__doc__ = "kind: 'full', 'window' or 'recurrent'; window_chunks -1 unless 'window'."


def group_infos(kv_cache_config, chunk_tokens):
    """GroupInfo per vLLM group, or ValueError when chunk_tokens does not
    suit a group (it must be a multiple of every group's block size)."""
    out = []
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        bs = int(spec.block_size)
        if bs <= 0 or chunk_tokens % bs:
            raise ValueError("kvside: chunk_tokens %d is not a multiple of KV-cache group %d's block "
                             "size %d" % (chunk_tokens, gi, bs))
        name = type(spec).__name__
        if name == "MambaSpec" or hasattr(spec, "mamba_cache_mode"):
            mode = getattr(spec, "mamba_cache_mode", "align")
            if mode not in ("align", "all"):
                raise ValueError("kvside: KV-cache group %d is Mamba state with mamba_cache_mode %r; "
                                 "kvside needs prefix caching on (mode 'align')" % (gi, mode))
            kind, window = "recurrent", -1
        elif name == "SlidingWindowSpec":
            w = int(spec.sliding_window)
            kind, window = "window", max(1, -(-(w - 1) // chunk_tokens))
        else:
            kind, window = "full", -1
        out.append(GroupInfo(gi, kind, bs, chunk_tokens // bs, window))
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
