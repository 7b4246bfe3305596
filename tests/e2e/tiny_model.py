"""A tiny hybrid decoder, written out by hand in PyTorch (float32, CPU).

Random weights from a fixed seed. Token embedding, then layers of three
kinds, each a pre-norm mixer plus a SwiGLU MLP, then an LM head:

- "full":      multi-head causal attention with RoPE over every earlier token;
- "window":    the same with a sliding window of ``window`` tokens (a query
               at position p sees keys p-window+1 .. p);
- "recurrent": a gated linear recurrence with a matrix state per channel
               (a tiny Mamba-like layer): h_t = a_t * h_{t-1} + (1 - a_t) u_t B_t^T,
               y_t = h_t C_t, output (y * silu(z)) W_o.

Tensor parallel over ``tp`` ranks, Megatron style: rank r owns heads
[r*H/tp, (r+1)*H/tp) of every attention layer (its K/V cache holds only those
heads) and channels [r*R/tp, (r+1)*R/tp) of the recurrent layer (its state
holds only those); the ranks' partial outputs are summed in rank order (the
all-reduce). The ranks run one after another in this process.

The model owns no cache. ``forward`` gets a cache object from the engine:

    cache.kv(layer, rank, start, k, v, lo) -> (K, V)
        writes k, v ([L, heads_per_rank, head_dim], RoPE applied) at positions
        start..start+L-1 and returns the keys/values of positions lo..start+L-1
    cache.state(layer, rank) -> tensor [channels_per_rank, state_dim]
        the sequence's running state, updated in place
"""

import math

import torch

FULL, WINDOW, RECURRENT = "full", "window", "recurrent"


class TinyConfig:
    def __init__(self, vocab=512, d_model=64, n_heads=4, head_dim=16, d_ff=192,
                 layers=(FULL, WINDOW, RECURRENT, FULL, FULL), window=64, rec_channels=64,
                 rec_state=16, tp=2, rope_theta=10000.0, max_pos=4096, seed=1234):
        self.vocab, self.d_model, self.n_heads, self.head_dim, self.d_ff = (
            vocab, d_model, n_heads, head_dim, d_ff)
        self.layers, self.window = tuple(layers), window
        self.rec_channels, self.rec_state = rec_channels, rec_state
        self.tp, self.rope_theta, self.max_pos, self.seed = tp, rope_theta, max_pos, seed
        if n_heads % tp or rec_channels % tp:
            raise ValueError("heads and recurrent channels must divide by tp")

    @property
    def heads_per_rank(self):
        return self.n_heads // self.tp

    @property
    def channels_per_rank(self):
        return self.rec_channels // self.tp


def _rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TinyModel:
    def __init__(self, cfg):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        d, hd, H, R, S = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.rec_channels, cfg.rec_state

        def rnd(*shape, std):
            return torch.randn(*shape, generator=g) * std

        def split_cols(w, parts):
            return [c.contiguous() for c in w.chunk(parts, dim=1)]

        def split_rows(w, parts):
            return [c.contiguous() for c in w.chunk(parts, dim=0)]

        self.embed = rnd(cfg.vocab, d, std=1.0)
        self.layers = []
        for kind in cfg.layers:
            p = {"ln1": 1 + rnd(d, std=0.1), "ln2": 1 + rnd(d, std=0.1),
                 "w1": rnd(d, cfg.d_ff, std=d ** -0.5), "w3": rnd(d, cfg.d_ff, std=d ** -0.5),
                 "w2": rnd(cfg.d_ff, d, std=cfg.d_ff ** -0.5)}
            if kind in (FULL, WINDOW):
                p["wq"] = split_cols(rnd(d, H * hd, std=d ** -0.5), cfg.tp)
                p["wk"] = split_cols(rnd(d, H * hd, std=d ** -0.5), cfg.tp)
                p["wv"] = split_cols(rnd(d, H * hd, std=d ** -0.5), cfg.tp)
                p["wo"] = split_rows(rnd(H * hd, d, std=(H * hd) ** -0.5), cfg.tp)
            elif kind == RECURRENT:
                p["wu"] = split_cols(rnd(d, R, std=d ** -0.5), cfg.tp)
                p["wz"] = split_cols(rnd(d, R, std=d ** -0.5), cfg.tp)
                p["wa"] = split_cols(rnd(d, R, std=0.3 * d ** -0.5), cfg.tp)
                # decays sigmoid(2..5) = 0.88..0.99: the state remembers tens of tokens
                p["ba"] = list((2 + 3 * torch.rand(R, generator=g)).chunk(cfg.tp))
                p["wb"] = rnd(d, S, std=d ** -0.5)
                p["wc"] = rnd(d, S, std=d ** -0.5)
                p["wo"] = split_rows(rnd(R, d, std=2 * R ** -0.5), cfg.tp)
            else:
                raise ValueError("unknown layer kind %r" % kind)
            self.layers.append(p)
        self.ln_f = 1 + rnd(d, std=0.1)
        self.lm_head = rnd(d, cfg.vocab, std=d ** -0.5)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(cfg.max_pos, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos(), ang.sin()

    def _rope(self, x, pos):
        # x [L, h, hd], rotate-half form
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    def _attention(self, i, p, x, start, cache, window):
        cfg = self.cfg
        L, hpr, hd = x.shape[0], cfg.heads_per_rank, cfg.head_dim
        pos = torch.arange(start, start + L)
        lo = 0 if window is None else max(0, start - window + 1)
        kpos = torch.arange(lo, start + L)
        visible = kpos[None, :] <= pos[:, None]
        if window is not None:
            visible &= kpos[None, :] > pos[:, None] - window
        out = None
        for r in range(cfg.tp):
            q = self._rope((x @ p["wq"][r]).view(L, hpr, hd), pos)
            k = self._rope((x @ p["wk"][r]).view(L, hpr, hd), pos)
            v = (x @ p["wv"][r]).view(L, hpr, hd)
            K, V = cache.kv(i, r, start, k, v, lo)
            scores = torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(hd)
            scores = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", scores, V).reshape(L, hpr * hd) @ p["wo"][r]
            out = o if out is None else out + o
        return out

    def _recurrent(self, i, p, x, cache):
        out = None
        b, c = x @ p["wb"], x @ p["wc"]                  # [L, S], the same on every rank
        for r in range(self.cfg.tp):
            u, z = x @ p["wu"][r], x @ p["wz"][r]        # [L, R/tp]
            a = torch.sigmoid(x @ p["wa"][r] + p["ba"][r])
            state = cache.state(i, r)                    # [R/tp, S], in the engine's memory
            h = state.clone()
            ys = []
            for t in range(x.shape[0]):
                h = a[t][:, None] * h + ((1 - a[t]) * u[t])[:, None] * b[t][None, :]
                ys.append(h @ c[t])
            state.copy_(h)
            o = (torch.stack(ys) * torch.nn.functional.silu(z)) @ p["wo"][r]
            out = o if out is None else out + o
        return out

    def forward(self, tokens, start, cache):
        """Logits [L, vocab] of tokens at positions start..start+L-1, whose
        earlier context the cache holds."""
        cfg = self.cfg
        x = self.embed[torch.as_tensor(tokens, dtype=torch.long)]
        for i, (kind, p) in enumerate(zip(cfg.layers, self.layers)):
            h = _rms_norm(x, p["ln1"])
            if kind == RECURRENT:
                x = x + self._recurrent(i, p, h, cache)
            else:
                x = x + self._attention(i, p, h, start, cache, cfg.window if kind == WINDOW else None)
            h = _rms_norm(x, p["ln2"])
            x = x + (torch.nn.functional.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        return _rms_norm(x, self.ln_f) @ self.lm_head
