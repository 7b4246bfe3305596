"""A paged engine around a transformers causal LM, with kvside prefix caching
(GPU version of engine.py, issue 14).

The model runs unchanged, with its own cache classes: the engine calls
``model(input_ids, past_key_values=cache, ...)`` chunk by chunk and keeps the
cache object the model returns. At every chunk end it copies the chunk's KV of
every attention layer out of that cache object into paged blocks, and
snapshots the recurrent states (conv and SSM / recurrent state of every Mamba
/ linear-attention layer) into a state slot. The blocks live in the TP rank
processes' kvside-registered CUDA memory (tp_ranks.py, mapped here through
paged.MappedPool): rank r holds heads [r*H/W, (r+1)*H/W) of every layer's KV
and channels / heads [r*N/W, (r+1)*N/W) of every state tensor (split along the
first dimension after the batch), in one block table shared by the ranks, as
in vLLM.

store() sends chunks 0..n-1 in one kvside job over the ranks; restore() looks
a prompt up and retrieves the longest cached prefix into freshly allocated
blocks (every full-attention chunk, the window's trailing chunks only, the
state at the end of the prefix); rebuild() turns the restored blocks back into
the model's own cache object: it lets the model create and initialise its
cache on a one-token dummy forward, then puts the restored KV (and window
length) and the restored states in place of what that forward wrote.

Where the layers of the cache object live is found by looking: a layer object
in ``cache.layers[i]`` with ``keys``/``values``/``conv_states``/... tensors, or
per-layer lists on the cache (``key_cache``, ``conv_states``, ``ssm_states``,
``recurrent_states``). discover() runs one forward from scratch and reads the
layer kinds off the cache: KV holding every token (full attention), KV holding
fewer (a sliding window: its length is what the window keeps), states.

Step mode: some models' torch paths cannot continue a multi-token forward
from a cached recurrent state (they start the scan from zero); for those the
engine feeds every token after the first chunk one at a time (the decode
path, which does use the state). continuation_check() tells which applies.
"""

import inspect
import math
import sys
import time

import torch

import paged
from paged import FULL, RECURRENT, WINDOW

FULL_GID, WINDOW_GID, RECURRENT_GID = 0, 1, 2
KV_NAMES = (("k", ("keys", "key_cache")), ("v", ("values", "value_cache")))
STATE_NAMES = (("conv", ("conv_states", "conv_state")),
               ("rec", ("ssm_states", "recurrent_states", "ssm_state", "recurrent_state")))
_NAMES = dict(KV_NAMES)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- where a layer's tensors live in a transformers cache object ------------------------------

def _layer_obj(cache, i):
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple, torch.nn.ModuleList)) and i < len(layers):
        obj = layers[i]
        if obj is not None and not torch.is_tensor(obj):
            return obj
    return None


def find(cache, i, names):
    """(owner, attribute, index or None) of layer i's tensor under one of names."""
    obj = _layer_obj(cache, i)
    if obj is not None:
        for n in names:
            v = getattr(obj, n, None)
            if torch.is_tensor(v):
                return (obj, n, None)
            if isinstance(v, dict) and torch.is_tensor(v.get(0)):
                return (obj, n, 0)
    for n in names:
        seq = getattr(cache, n, None)
        if isinstance(seq, (list, tuple)) and i < len(seq) and torch.is_tensor(seq[i]):
            return (cache, n, i)
        if isinstance(seq, dict) and torch.is_tensor(seq.get(i)):
            return (cache, n, i)
    return None


def state_locs(cache, i):
    """[(role, loc)] of layer i's recurrent state tensors: "conv" and "rec" (an
    SSM / linear-attention state), "conv1", "rec1"... for a layer holding
    several (per-layer dicts of state index -> tensor, as transformers 5 has)."""
    out = []
    obj = _layer_obj(cache, i)
    for role, names in STATE_NAMES:
        done = False
        if obj is not None:
            for n in names:
                v = getattr(obj, n, None)
                if torch.is_tensor(v):
                    out.append((role, (obj, n, None)))
                elif isinstance(v, dict):
                    out += [(role + (str(j) if j else ""), (obj, n, j))
                            for j in sorted(v) if torch.is_tensor(v[j])]
                else:
                    continue
                done = True
                break
        if not done:
            loc = find(cache, i, names)
            if loc is not None:
                out.append((role, loc))
    return [(r, loc) for r, loc in out if get(loc).dim() >= 2 and get(loc).numel() > 0]


def get(loc):
    owner, n, i = loc
    v = getattr(owner, n)
    return v if i is None else v[i]


def put(loc, t):
    owner, n, i = loc
    if i is None:
        setattr(owner, n, t)
    else:
        getattr(owner, n)[i] = t


def describe(cache, max_layers=4):
    """A short account of a cache object's structure (for the log)."""
    def one(v):
        if torch.is_tensor(v):
            return "tensor%s %s" % (tuple(v.shape), str(v.dtype).replace("torch.", ""))
        if v is None or isinstance(v, (int, float, bool, str)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "%s[%d]{%s}" % (type(v).__name__, len(v), ", ".join(one(x) for x in v[:max_layers]))
        return type(v).__name__
    out = [type(cache).__module__ + "." + type(cache).__name__]
    try:
        items = sorted(vars(cache).items())
    except TypeError:
        items = []
    for k, v in items:
        if k == "layers" and isinstance(v, (list, tuple)):
            out.append("  layers[%d]:" % len(v))
            for j, lay in enumerate(v[:max_layers]):
                attrs = ", ".join("%s=%s" % (a, one(b)) for a, b in sorted(vars(lay).items())
                                  if not a.startswith("__")) if hasattr(lay, "__dict__") else one(lay)
                out.append("    [%d] %s: %s" % (j, type(lay).__name__, attrs))
        else:
            out.append("  %s = %s" % (k, one(v)))
    return "\n".join(out)


class LayerInfo:
    def __init__(self, i):
        self.i, self.kv, self.kept, self.kvh, self.hd, self.kv_dtype = i, None, 0, 0, 0, None
        self.states = []        # (role, shape without the batch, dtype)

    def __repr__(self):
        parts = []
        if self.kv:
            parts.append("%s attention (%d KV heads x %d%s)" % (
                self.kv, self.kvh, self.hd, ", keeps %d tokens" % self.kept if self.kv == WINDOW else ""))
        for role, shape, dt in self.states:
            parts.append("%s state %s %s" % (role, shape, str(dt).replace("torch.", "")))
        return "L%d: %s" % (self.i, " + ".join(parts) or "no cache")


# ---- the engine --------------------------------------------------------------------------------

class HFEngine:
    """model: a transformers causal LM on a CUDA device. The paged layout (kvside
    groups, one TP rank's share) follows from discover(); attach() gives the
    engine the rank processes whose pools hold the blocks."""

    def __init__(self, model, tokens_per_block=16, blocks_per_chunk=2, num_blocks=64, num_slots=24,
                 world=2, step_mode=False, window_pad=256, dummy_token=0):
        self.model, self.cfg = model, model.config
        self.dev = next(model.parameters()).device
        self.T, self.B = tokens_per_block, blocks_per_chunk
        self.C = self.T * self.B
        self.world, self.step_mode, self.dummy_token = world, step_mode, dummy_token
        params = inspect.signature(model.forward).parameters
        self._kw_cache_position = "cache_position" in params
        self._kw_logits = "logits_to_keep" in params
        self._cache_factory = None
        self.cache, self.length, self.ranks, self.pools = None, 0, None, []
        self.layers = self.discover()
        self.groups = self._layout(num_blocks, num_slots, window_pad)
        self.by_gid = {g.gid: g for g in self.groups}
        self.begin(0)

    # -- the model

    def _explicit_cache(self):
        """A cache object made here, for models that return none by themselves
        (older hybrid models want theirs passed in)."""
        mod = sys.modules[type(self.model).__module__]
        dtype = next(self.model.parameters()).dtype
        names = sorted((n for n in dir(mod) if n.endswith("Cache") and isinstance(getattr(mod, n), type)),
                       key=lambda n: "Hybrid" not in n)
        for n in names:
            cls = getattr(mod, n)
            for args, kw in (((self.cfg, 1), {"dtype": dtype, "device": self.dev}),
                             ((), {"config": self.cfg}), ((self.cfg,), {})):
                try:
                    return cls(*args, **kw)
                except Exception:
                    continue
        raise RuntimeError("the model returns no cache and none of %s could be made" % names)

    def _run(self, ids, start, keep=1):
        """One model forward of ids at positions start..; the last position's
        logits (keep=0: every position's)."""
        inp = torch.tensor([ids], dtype=torch.long, device=self.dev)
        pos = torch.arange(start, start + len(ids), device=self.dev)
        kw = {"input_ids": inp, "use_cache": True, "position_ids": pos[None]}
        if self._kw_cache_position:
            kw["cache_position"] = pos
        if self._kw_logits:
            kw["logits_to_keep"] = keep
        if self.cache is None and self._cache_factory:
            self.cache = self._cache_factory()
        if self.cache is not None:
            kw["past_key_values"] = self.cache
        out = self.model(**kw)
        if out.past_key_values is None:
            if self.cache is None and start == 0 and not self._cache_factory:
                self._cache_factory = self._explicit_cache
                return self._run(ids, start, keep)
            raise RuntimeError("the model returned no cache")
        self.cache = out.past_key_values
        return out.logits[0] if keep == 0 else out.logits[0, -1]

    def forward(self, ids, start):
        """ids at positions start..: one forward, or in step mode (a recurrent
        model continuing from a cached state) one forward per token."""
        if self.step_mode and start > 0 and len(ids) > 1:
            last = None
            for j, t in enumerate(ids):
                last = self._run([t], start + j)
            return last
        return self._run(ids, start)

    def discover(self):
        """One forward from scratch; the layer kinds read off the model's cache."""
        C, W = self.C, self.world
        window = getattr(self.cfg, "sliding_window", None) or 0
        n = max(3 * C, window + C if window else 0)
        g = torch.Generator().manual_seed(99)
        toks = torch.randint(0, self.cfg.vocab_size, (n,), generator=g).tolist()
        self.cache = None
        with torch.no_grad():
            self._run(toks, 0)
        cache, self.cache = self.cache, None
        self.cache_type = type(cache).__name__
        self.cache_description = describe(cache)
        layers = []
        for i in range(self.cfg.num_hidden_layers):
            info = LayerInfo(i)
            loc = find(cache, i, _NAMES["k"])
            k = get(loc) if loc else None
            if k is not None and k.dim() == 4 and k.shape[-2] > 0:
                info.kept, info.kvh, info.hd, info.kv_dtype = k.shape[-2], k.shape[1], k.shape[3], k.dtype
                info.kv = FULL if info.kept >= n else WINDOW
                if info.kvh % W:
                    raise ValueError("layer %d: %d KV heads do not split over %d ranks" % (i, info.kvh, W))
                if info.kv == WINDOW and info.kept < C:
                    raise ValueError("layer %d keeps %d tokens, less than a chunk" % (i, info.kept))
            for role, loc in state_locs(cache, i):
                t = get(loc)
                if t.shape[0] != 1:
                    raise ValueError("layer %d: %s state %s has no batch of 1" % (i, role, tuple(t.shape)))
                if t.shape[1] % W:
                    raise ValueError("layer %d: %s state %s does not split over %d ranks"
                                     % (i, role, tuple(t.shape), W))
                info.states.append((role, tuple(t.shape[1:]), t.dtype))
            layers.append(info)
        self.cache_cls = type(cache)
        lays = getattr(cache, "layers", None)
        self.layer_types = [type(x).__name__ for x in lays] if isinstance(lays, list) else None
        return layers

    def _state_loc(self, cache, i, role):
        for r, loc in state_locs(cache, i):
            if r == role:
                return loc
        raise KeyError("layer %d has no %s state in this cache" % (i, role))

    def continuation_check(self):
        """How far logits of positions C..2C-1 are from one forward of 2C tokens
        when computed as C + C through the cache (chunk), and as C + one token
        at a time (step): relative max |diff| of each."""
        C = self.C
        g = torch.Generator().manual_seed(98)
        toks = torch.randint(0, self.cfg.vocab_size, (2 * C,), generator=g).tolist()
        saved = self.step_mode
        try:
            self.cache = None
            ref = self._run(toks, 0, keep=0)[C:].float()
            self.cache = None
            self._run(toks[:C], 0)
            chunk = self._run(toks[C:], C, keep=0).float()
            self.cache = None
            self._run(toks[:C], 0)
            step = torch.stack([self._run([t], C + j).float() for j, t in enumerate(toks[C:])])
        finally:
            self.cache, self.step_mode = None, saved
        scale = float(ref.abs().max())
        return float((chunk - ref).abs().max()) / scale, float((step - ref).abs().max()) / scale

    def _layout(self, num_blocks, num_slots, pad):
        T, B, C, W = self.T, self.B, self.C, self.world
        full, window, rec, kept = [], [], [], 0
        for L in self.layers:
            if L.kv:
                shape = (L.kvh // W, T, L.hd)
                specs = [paged.TensorSpec("L%d.%s" % (L.i, n), shape, L.kv_dtype) for n, _ in KV_NAMES]
                (full if L.kv == FULL else window).extend(specs)
                if L.kv == WINDOW:
                    kept = max(kept, L.kept)
            for role, shape, dt in L.states:
                rec.append(paged.TensorSpec("L%d.%s" % (L.i, role), (shape[0] // W,) + shape[1:], dt))
        groups = []
        if full:
            groups.append(paged.GroupSpec(FULL_GID, FULL, T, B, num_blocks, full))
        if window:
            groups.append(paged.GroupSpec(WINDOW_GID, WINDOW, T, B, num_blocks, window,
                                          window_chunks=math.ceil(kept / C), pad_bytes=pad))
        if rec:
            groups.append(paged.GroupSpec(RECURRENT_GID, RECURRENT, C, 1, num_slots, rec))
        return groups

    # -- the sequence

    def attach(self, ranks, seed):
        """Rank processes (tp_ranks.RankGroup) allocate this layout's pools."""
        self.ranks = ranks
        self.pools = ranks.new_pools(self.groups, seed)

    def begin(self, seed):
        """A new sequence: empty cache, block ids handed out in seed's order."""
        self.alloc = {g.gid: paged.BlockAllocator(g, seed) for g in self.groups}
        self.tables = {g.gid: [] for g in self.groups}
        self.cache, self.length, self.restored_slot, self.captured = None, 0, None, None
        self.restored = 0

    def fill_random(self, seed):
        for r, p in enumerate(self.pools):
            p.fill_random(seed * 100 + r)

    def _page_chunk(self, k):
        """Chunk k just ended: its KV into new blocks, the states into a new slot."""
        T, B, C, W = self.T, self.B, self.C, self.world
        for g in self.groups:
            if g.is_attention:
                t = self.tables[g.gid]
                while len(t) < (k + 1) * B:
                    t.append(self.alloc[g.gid].alloc()[0])
        for L in self.layers:
            if not L.kv:
                continue
            gid = FULL_GID if L.kv == FULL else WINDOW_GID
            idx = torch.tensor(self.tables[gid][k * B:(k + 1) * B], device=self.dev)
            h = L.kvh // W
            for name, names in KV_NAMES:
                x = get(find(self.cache, L.i, names))[0, :, -C:, :]          # [heads, C, hd]
                blocks = x.reshape(L.kvh, B, T, L.hd).permute(1, 0, 2, 3)    # [B, heads, T, hd]
                for r, pool in enumerate(self.pools):
                    pool.tensor(gid, "L%d.%s" % (L.i, name))[idx] = blocks[:, r * h:(r + 1) * h]
        if RECURRENT_GID in self.by_gid:
            slot = self.alloc[RECURRENT_GID].alloc()[0]
            for L in self.layers:
                for role, shape, _ in L.states:
                    x = get(self._state_loc(self.cache, L.i, role))[0]
                    p = shape[0] // W
                    for r, pool in enumerate(self.pools):
                        pool.tensor(RECURRENT_GID, "L%d.%s" % (L.i, role))[slot] = x[r * p:(r + 1) * p]
            t = self.tables[RECURRENT_GID]
            t.extend([None] * (k + 1 - len(t)))
            t[k] = slot

    def cache_tensors(self):
        """{tensor name: a copy} of what the model's cache object holds now."""
        out = {}
        for L in self.layers:
            for name, names in (KV_NAMES if L.kv else ()):
                out["L%d.%s" % (L.i, name)] = get(find(self.cache, L.i, names)).contiguous().clone()
            for role, _, _ in L.states:
                out["L%d.%s" % (L.i, role)] = get(self._state_loc(self.cache, L.i, role)).contiguous().clone()
        return out

    def cache_meta(self):
        """The plain (int, float, bool) attributes of the cache object and of its
        layer objects: counters and flags a rebuilt cache should share too."""
        def plain(o):
            try:
                items = vars(o).items()
            except TypeError:
                return {}
            out = {}
            for k, v in items:
                if isinstance(v, (bool, int, float)):
                    out[k] = v
                elif isinstance(v, dict):
                    out.update({"%s[%r]" % (k, j): x for j, x in v.items() if isinstance(x, (bool, int, float))})
            return out
        out = {"cache." + k: v for k, v in plain(self.cache).items()}
        for i, lay in enumerate(getattr(self.cache, "layers", None) or []):
            out.update({"layers[%d].%s" % (i, k): v for k, v in plain(lay).items()})
        return out

    def prefill(self, tokens, start=0, page=True, capture_at=None):
        """Computes tokens[start:] (the cache holds tokens[:start]) in steps that
        end on chunk boundaries, paging every completed chunk (page=True);
        capture_at: keep a copy of the cache tensors once that many tokens are
        in (self.captured). Returns the last position's logits."""
        if start != self.length:
            raise RuntimeError("the cache holds %d tokens, not %d" % (self.length, start))
        s, last = start, None
        while s < len(tokens):
            e = min((s // self.C + 1) * self.C, len(tokens))
            last = self.forward(tokens[s:e], s)
            self.length = e
            if page and e % self.C == 0:
                self._page_chunk(e // self.C - 1)
            if capture_at == e:
                self.captured = self.cache_tensors()
                self.captured_meta = self.cache_meta()
            s = e
        return last

    def generate(self, prompt, n_new, start=0, page=False, capture_at=None, one_forward=False):
        """Prefill prompt[start:] (one_forward: in a single forward instead of
        chunk steps), then greedy decoding: (tokens, logits of each).
        self.prefill_seconds: prefill to the first token's id."""
        t0 = time.perf_counter()
        if one_forward:
            last = self.forward(prompt[start:], start)
            self.length = len(prompt)
        else:
            last = self.prefill(prompt, start, page, capture_at)
        toks, logits = [], []
        while True:
            toks.append(int(last.argmax()))
            if len(toks) == 1:
                self.prefill_seconds = time.perf_counter() - t0
            logits.append(last.float().clone())
            if len(toks) == n_new:
                return toks, torch.stack(logits)
            last = self.forward([toks[-1]], self.length)
            self.length += 1

    # -- kvside

    def store(self, keys):
        """Chunks 0..len(keys)-1 of the sequence in one job over every rank."""
        if len(keys) * self.C > self.length:
            raise RuntimeError("chunk %d is not computed" % (len(keys) - 1))
        sync(self.dev)
        self.ranks.job("store", keys, paged.block_lists(self.groups, self.tables, len(keys)))

    def restore(self, keys):
        """Looks keys up and retrieves the longest cached prefix into new blocks
        (and the state at its end into a new slot). Returns (hits, tiers); the
        model's cache is rebuilt by rebuild()."""
        if self.length:
            raise RuntimeError("restore() starts a sequence")
        hits, tiers = self.ranks.lookup(keys)
        n = hits
        if n == 0:
            return hits, tiers
        tables = {}
        for g in self.groups:
            if g.is_attention:  # blocks only for the chunks the retrieve writes
                need, bpc = set(paged.needed_chunks(g, n)), g.blocks_per_chunk
                tables[g.gid] = [b for k in range(n)
                                 for b in (self.alloc[g.gid].alloc(bpc) if k in need else [None] * bpc)]
        if RECURRENT_GID in self.by_gid:
            self.restored_slot = self.alloc[RECURRENT_GID].alloc()[0]
            tables[RECURRENT_GID] = [None] * (n - 1) + [self.restored_slot]
        self.ranks.job("retrieve", keys[:n], paged.block_lists(self.groups, tables, n))
        self.tables = tables
        self.restored = n
        return hits, tiers

    def restore_state(self, keys, chunk):
        """Retrieves only the state at the end of chunk (keys[0..chunk]) into the
        restored slot; the attention blocks stay as they are."""
        tables = {RECURRENT_GID: [None] * chunk + [self.restored_slot]}
        self.ranks.job("retrieve", keys[:chunk + 1], paged.block_lists(self.groups, tables, chunk + 1))

    def _empty_cache(self):
        """An empty cache of the class the model makes for itself, built the way
        the model builds it (transformers 5: DynamicCache(config=...), its layer
        objects typed per layer); None if that cannot be matched."""
        if self.layer_types is None:
            return None
        try:
            c = self.cache_cls(config=self.cfg)
        except Exception:
            return None
        lays = getattr(c, "layers", None)
        if not isinstance(lays, list) or [type(x).__name__ for x in lays] != self.layer_types:
            return None
        return c

    def _restored_kv(self, L, name):
        n, T = self.restored, self.T
        gid = FULL_GID if L.kv == FULL else WINDOW_GID
        ids = [b for k in paged.needed_chunks(self.by_gid[gid], n)
               for b in self.tables[gid][k * self.B:(k + 1) * self.B]]
        idx = torch.tensor(ids, device=self.dev)
        parts = [p.tensor(gid, "L%d.%s" % (L.i, name))[idx] for p in self.pools]
        return torch.cat(parts, dim=1).permute(1, 0, 2, 3).reshape(1, L.kvh, len(ids) * T, L.hd)

    def _restored_state(self, L, role):
        name = "L%d.%s" % (L.i, role)
        return torch.cat([p.tensor(RECURRENT_GID, name)[self.restored_slot] for p in self.pools])[None]

    def rebuild(self):
        """The model's own cache object from the restored blocks. transformers 5:
        an empty cache made as the model makes it, filled through its own update
        methods (update, update_conv_state, update_recurrent_state) as a forward
        would; otherwise the model makes and initialises its cache on a
        one-token dummy forward, and the restored KV and states replace what
        that forward wrote. Either way the token count of sliding-window layers
        is set to the prefix length."""
        n, C = self.restored, self.C
        cache = self._empty_cache()
        self.rebuild_path = "empty cache + update" if cache is not None else "dummy forward + overwrite"
        if cache is not None:
            for L in self.layers:
                if L.kv:
                    cache.update(self._restored_kv(L, "k"), self._restored_kv(L, "v"), L.i)
                for role, _, _ in L.states:
                    x = self._restored_state(L, role)
                    j = int(role[len(role.rstrip("0123456789")):] or 0)
                    if role.startswith("conv"):
                        cache.update_conv_state(x, L.i, state_idx=j, conv_kernel_size=x.shape[-1])
                    else:
                        cache.update_recurrent_state(x, L.i, state_idx=j)
            self.cache = cache
        else:
            self.cache = None
            self._run([self.dummy_token], 0)
            for L in self.layers:
                if L.kv:
                    for name, names in KV_NAMES:
                        put(find(self.cache, L.i, names), self._restored_kv(L, name))
                for role, _, _ in L.states:
                    x = self._restored_state(L, role)
                    loc = self._state_loc(self.cache, L.i, role)
                    cur = get(loc)
                    if cur.shape == x.shape and cur.dtype == x.dtype:
                        cur.copy_(x)
                    else:
                        put(loc, x.contiguous())
        for L in self.layers:
            obj = _layer_obj(self.cache, L.i)
            if L.kv == WINDOW and cache is None:
                for name, names in KV_NAMES:      # the window's tail, as the layer keeps it
                    loc = find(self.cache, L.i, names)
                    put(loc, get(loc)[:, :, -min(L.kept, n * C):])
            if obj is not None and isinstance(getattr(obj, "cumulative_length", None), int):
                obj.cumulative_length = n * C      # tokens seen (a sliding window's mask needs it)
        self.length = n * C

    def object_blocks(self, gid, chunk):
        g = self.by_gid[gid]
        if g.is_attention:
            ids = self.tables[gid][chunk * g.blocks_per_chunk:(chunk + 1) * g.blocks_per_chunk]
        else:
            t = self.tables[gid]
            ids = [t[chunk] if chunk < len(t) else None]
        if len(ids) != (g.blocks_per_chunk if g.is_attention else 1) or None in ids:
            raise KeyError("no blocks for group %d chunk %d" % (gid, chunk))
        return ids

    def object_bytes(self, rank, gid, chunk):
        """This rank's bytes of (group, chunk), laid out as the kvside object."""
        sync(self.dev)
        return self.pools[rank].object_bytes(gid, self.object_blocks(gid, chunk))

    def prefix_objects(self, n):
        return {(r, g.gid, k): self.object_bytes(r, g.gid, k)
                for r in range(len(self.pools)) for g in self.groups for k in paged.needed_chunks(g, n)}


def same_tensors(a, b):
    """Names whose tensors differ (shape, dtype or any byte) between two
    cache_tensors() dicts."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad
