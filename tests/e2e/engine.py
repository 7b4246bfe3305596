"""A small paged inference engine for TinyModel, with kvside prefix caching.

One sequence at a time. Its KV cache and recurrent state live in paged blocks
of one HostPool per TP rank (paged.py); the ranks share one block table (the
same block ids on every rank, as in vLLM), each rank's blocks holding its
half of the KV heads / recurrent channels. kvside groups:

  FULL_GID      full attention: K and V of every "full" layer, tokens_per_block
                T, blocks_per_chunk B (chunk = C = T*B tokens)
  WINDOW_GID    the "window" layer's K and V, window_chunks = window / C,
                padded block stride
  RECURRENT_GID the "recurrent" layer's state, one slot per snapshot
                (tokens_per_block C, 1 block per chunk, slot 0 = null)

Prefill runs in chunk-aligned steps; after each step that ends on a chunk
boundary the running state is snapshotted into a fresh slot (the state at the
chunk's end boundary). store() sends chunks 0..n-1 of the sequence in one
kvside job over both ranks; restore() looks the prompt's keys up and
retrieves the longest cached prefix into freshly allocated blocks: every
full-attention block, the window's trailing chunks (no block at all for the
chunks before the window), and the state at the end of the prefix written
straight into the sequence's running slot.
"""

import time

import torch

import paged
from paged import FULL, RECURRENT, WINDOW
from tiny_model import FULL as M_FULL, RECURRENT as M_REC, WINDOW as M_WINDOW

FULL_GID, WINDOW_GID, RECURRENT_GID = 0, 1, 2


def layout(cfg, tokens_per_block=16, blocks_per_chunk=2, num_blocks=64, num_slots=24):
    """The kvside groups of TinyModel's cache for one rank."""
    T, C = tokens_per_block, tokens_per_block * blocks_per_chunk
    if cfg.window % C:
        raise ValueError("the window must be a multiple of the chunk size")
    kv_shape = (T, cfg.heads_per_rank, cfg.head_dim)
    full, window, rec = [], [], []
    for i, kind in enumerate(cfg.layers):
        if kind == M_REC:
            rec.append(paged.TensorSpec("L%d.state" % i, (cfg.channels_per_rank, cfg.rec_state)))
        else:
            (window if kind == M_WINDOW else full).extend(
                [paged.TensorSpec("L%d.k" % i, kv_shape), paged.TensorSpec("L%d.v" % i, kv_shape)])
    groups = []
    if full:
        groups.append(paged.GroupSpec(FULL_GID, FULL, T, blocks_per_chunk, num_blocks, full))
    if window:
        groups.append(paged.GroupSpec(WINDOW_GID, WINDOW, T, blocks_per_chunk, num_blocks, window,
                                      window_chunks=cfg.window // C, pad_bytes=256))
    if rec:
        groups.append(paged.GroupSpec(RECURRENT_GID, RECURRENT, C, 1, num_slots, rec))
    return groups


class Engine:
    """model: a TinyModel. broker_dir: the kvside server's run directory, or
    None for an engine without kvside (the full-recompute reference). seed:
    garbage in the pools and the order in which block ids are handed out.
    register_order: {gid: tensor names} registers a group's tensors in
    another order than the engine uses them (a broken engine, for the
    negative checks)."""

    def __init__(self, model, broker_dir=None, namespace="e2e-tiny", name="e2e-engine", seed=0,
                 register_order=None, **layout_args):
        self.model, self.cfg = model, model.cfg
        self.groups = layout(self.cfg, **layout_args)
        self.by_gid = {g.gid: g for g in self.groups}
        self.T = self.groups[0].tokens_per_block
        self.C = self.groups[0].chunk_tokens
        self.kv_names, self.state_names = {}, {}
        for i, kind in enumerate(self.cfg.layers):
            if kind == M_REC:
                self.state_names[i] = "L%d.state" % i
            else:
                self.kv_names[i] = (FULL_GID if kind == M_FULL else WINDOW_GID, "L%d.k" % i, "L%d.v" % i)
        self.pools, self.conn = [], None
        try:
            for r in range(self.cfg.tp):
                self.pools.append(paged.HostPool(self.groups, name="e2e-rank%d" % r))
                self.pools[-1].fill_random(seed * 100 + r)
            if broker_dir is not None:
                self.conn = paged.TPConnector(name, namespace, self.cfg.tp, broker_dir)
                self.conn.register(self.pools, register_order)
        except BaseException:
            self.close()
            raise
        self.alloc = {g.gid: paged.BlockAllocator(g, seed) for g in self.groups}
        self.tables = {g.gid: [] for g in self.groups}
        self.state_slot = self.alloc[RECURRENT_GID].alloc()[0] if RECURRENT_GID in self.by_gid else None
        self.restored_state = None      # (chunk, slot) right after restore()
        self.length = 0
        self._zero_state()

    # -- the cache interface TinyModel uses

    def _rows(self, gid, lo, hi):
        table = torch.tensor([-1 if b is None else b for b in self.tables[gid]], dtype=torch.long)
        pos = torch.arange(lo, hi)
        blk = table[pos // self.T]
        if bool((blk < 0).any()):
            raise RuntimeError("group %d: positions %d..%d touch a block the engine does not hold"
                               % (gid, lo, hi - 1))
        return blk, pos % self.T

    def kv(self, layer, rank, start, k, v, lo):
        gid, kn, vn = self.kv_names[layer]
        K, V = self.pools[rank].tensor(gid, kn), self.pools[rank].tensor(gid, vn)
        blk, off = self._rows(gid, start, start + k.shape[0])
        K[blk, off] = k
        V[blk, off] = v
        blk, off = self._rows(gid, lo, start + k.shape[0])
        return K[blk, off], V[blk, off]

    def state(self, layer, rank):
        return self.pools[rank].tensor(RECURRENT_GID, self.state_names[layer])[self.state_slot]

    # -- the sequence

    def _zero_state(self):
        for pool in self.pools:
            for name in self.state_names.values():
                pool.tensor(RECURRENT_GID, name)[self.state_slot].zero_()

    def _grow(self, n_tokens):
        for g in self.groups:
            if g.is_attention:
                t = self.tables[g.gid]
                while len(t) * self.T < n_tokens:
                    t.append(self.alloc[g.gid].alloc()[0])

    def _snapshot(self, chunk):
        """The running state, now at the end boundary of chunk, into a new slot."""
        slot = self.alloc[RECURRENT_GID].alloc()[0]
        for pool in self.pools:
            for name in self.state_names.values():
                v = pool.tensor(RECURRENT_GID, name)
                v[slot] = v[self.state_slot]
        t = self.tables[RECURRENT_GID]
        t.extend([None] * (chunk + 1 - len(t)))
        t[chunk] = slot

    def forward(self, tokens, start):
        self._grow(start + len(tokens))
        logits = self.model.forward(tokens, start, self)
        self.length = start + len(tokens)
        return logits

    def prefill(self, tokens, start=0, snapshot=False):
        """Computes tokens[start:] (the cache holds tokens[:start]) in steps that
        end on chunk boundaries; returns the last position's logits."""
        if start != self.length:
            raise RuntimeError("the cache holds %d tokens, not %d" % (self.length, start))
        s, last = start, None
        while s < len(tokens):
            e = min((s // self.C + 1) * self.C, len(tokens))
            last = self.forward(tokens[s:e], s)[-1]
            if snapshot and e % self.C == 0 and RECURRENT_GID in self.by_gid:
                self._snapshot(e // self.C - 1)
            s = e
        return last

    def generate(self, prompt, n_new, start=0, snapshot=False):
        """Prefill prompt[start:], then greedy decoding: (tokens, logits of each)."""
        t0 = time.perf_counter()
        last = self.prefill(prompt, start, snapshot)
        self.prefill_seconds = time.perf_counter() - t0
        toks, logits = [], []
        while True:
            toks.append(int(last.argmax()))
            logits.append(last.clone())
            if len(toks) == n_new:
                return toks, torch.stack(logits)
            last = self.forward([toks[-1]], self.length)[-1]

    # -- kvside

    def store(self, keys):
        """Stores chunks 0..len(keys)-1 of the sequence (one job, every rank):
        attention blocks of every chunk, the state snapshots taken."""
        if len(keys) * self.C > self.length:
            raise RuntimeError("chunk %d is not computed" % (len(keys) - 1))
        self.conn.store(keys, paged.block_lists(self.groups, self.tables, len(keys)))

    def restore(self, keys):
        """Looks keys up and retrieves the longest cached prefix into new blocks.
        Returns the Lookup (hits = chunks restored, tiers)."""
        if self.length:
            raise RuntimeError("restore() starts a sequence")
        hit = self.conn.lookup(keys)
        n = hit.hits
        if n == 0:
            return hit
        tables = {}
        for g in self.groups:
            if g.is_attention:  # blocks only for the chunks the retrieve writes
                need, bpc = set(paged.needed_chunks(g, n)), g.blocks_per_chunk
                tables[g.gid] = [b for k in range(n)
                                 for b in (self.alloc[g.gid].alloc(bpc) if k in need else [None] * bpc)]
        dest = dict(tables)
        if RECURRENT_GID in self.by_gid:
            # the state at the end of the prefix goes straight into the running slot
            dest[RECURRENT_GID] = [None] * (n - 1) + [self.state_slot]
            tables[RECURRENT_GID] = []     # no snapshots of this sequence yet
        self.conn.retrieve(keys[:n], paged.block_lists(self.groups, dest, n))
        self.tables = tables
        self.restored_state = (n - 1, self.state_slot)
        self.length = n * self.C
        return hit

    def restore_state(self, keys, chunk):
        """Retrieves only the state at the end of chunk (keys[0..chunk]) into the
        running slot; the attention blocks are left as they are."""
        tables = {RECURRENT_GID: [None] * chunk + [self.state_slot]}
        self.conn.retrieve(keys[:chunk + 1], paged.block_lists(self.groups, tables, chunk + 1))

    def object_blocks(self, gid, chunk):
        """The block ids holding (group, chunk): the chunk's attention blocks, or
        the slot of the state at its end (a snapshot, or the running slot right
        after restore())."""
        g = self.by_gid[gid]
        if g.is_attention:
            ids = self.tables[gid][chunk * g.blocks_per_chunk:(chunk + 1) * g.blocks_per_chunk]
        else:
            t = self.tables[gid]
            slot = t[chunk] if chunk < len(t) else None
            if slot is None and self.restored_state and self.restored_state[0] == chunk:
                slot = self.restored_state[1]
            ids = [slot]
        if len(ids) != (g.blocks_per_chunk if g.is_attention else 1) or None in ids:
            raise KeyError("no blocks for group %d chunk %d" % (gid, chunk))
        return ids

    def object_bytes(self, rank, gid, chunk):
        """This rank's bytes of (group, chunk), laid out as the kvside object."""
        return self.pools[rank].object_bytes(gid, self.object_blocks(gid, chunk))

    def prefix_objects(self, n):
        """{(rank, gid, chunk): bytes} of every object a retrieve of n chunks writes."""
        return {(r, g.gid, k): self.object_bytes(r, g.gid, k)
                for r in range(len(self.pools)) for g in self.groups for k in paged.needed_chunks(g, n)}

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        for p in self.pools:
            p.close()
        self.pools = []
