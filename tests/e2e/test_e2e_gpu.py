#!/usr/bin/env python3
"""Prefix caching proven on real model code, GPU version (issue 14).

Models from HuggingFace transformers, built from configs with random weights
(fixed seed; no downloads), run unchanged with their own cache classes in a
paged engine (hf_engine.py) whose blocks live in the kvside-registered CUDA
memory of two TP rank processes (tp_ranks.py: each rank process allocates
its pool through kvside.torch_alloc, registers it with Client.register_cuda
and runs its part of every job; rank r holds half of the KV heads of every
layer and half of the channels / heads of every recurrent state). Three model
kinds: full attention (LlamaConfig), sliding window (MistralConfig with
sliding_window; Gemma3 / Gemma2 if Mistral's cache kept no window) and a
hybrid with recurrent layers: every one of Bamba, NemotronH, FalconH1,
Qwen3-Next, Jamba is probed (builds, runs on the torch-only path, continues a
multi-token forward from its cached state?) and the first that does is used
(Bamba with transformers 5.17: Mamba2 layers 0, 2, 3 and attention layers 1,
4, its SSMs set to decay slowly so that the state carries the context; a
model that cannot continue from its state would be fed token by token after
the first chunk).

For each model, against a real kvside-server with L2:

1. prompt A (6 chunks of 32 tokens + 8) is prefilled chunk by chunk; at every
   chunk end the chunk's KV is copied into paged blocks and the recurrent
   states into a state slot; the 6 chunks are stored in one job over both
   ranks;
2. prompt B = A's first 4 chunks + 40 new tokens is computed from scratch
   (the same engine, no restore) and greedy-decodes 32 tokens: the reference;
   its prefix objects must equal A's (deterministic prefill) and its cache
   object at the prefix boundary is kept;
3. pools refilled with random bytes, other block ids: B's prefix is looked up
   (4 hits from L1), retrieved, checked byte for byte against A's objects (and
   nothing else in the pools written), turned back into the model's cache
   object (which must equal the reference's at the boundary byte for byte),
   only the suffix is computed and 32 tokens decoded: identical to the
   reference's; the maximum absolute logit difference is printed;
4. the test can fail: the recurrent states of chunk n-2 instead of n-1, and
   for every group with two layers or more a registration listing two layers
   in swapped order (each layer gets the other one's KV / state), must decode
   other tokens;
5. the server is restarted on its L2 and step 3 is repeated from L2.

Then the time to first token of B (prefix + 128 new tokens) with the prefix
restored against recomputed, on a larger Llama-style model (bf16, 16 layers,
hidden 2048, 0.9 B parameters) and prefixes of 2k-16k tokens in 256-token
chunks.

Environment: KVS_SERVER, KVSIDE_LIB, PYTHONPATH holding worker/python (see
tests/gpu/gpu-run.sh remote-e2e). Exits 77 (skipped) without torch, CUDA,
transformers, or a libkvside with CUDA support.

Options: --models llama,mistral,hybrid  --hybrid NAME  --no-timing
         --timing-lengths 2048,4096,8192,16384  --dump-src DIR (a tarball of the
         transformers sources that matter here, for reading elsewhere)
"""

import argparse
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

NS_BASE = "e2e-gpu"
PROMPT_CHUNKS, TAIL = 6, 8
PREFIX_CHUNKS, SUFFIX = 4, 40
N_NEW = 32
HYBRIDS = ("bamba", "nemotron_h", "falcon_h1", "qwen3_next", "jamba")


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


# ---- models ------------------------------------------------------------------------------------

def tiny_common():
    return dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096, initializer_range=0.08,
                tie_word_embeddings=False)


def model_config(tf, kind):
    c = tiny_common()
    if kind == "llama":
        return tf.LlamaConfig(num_hidden_layers=4, head_dim=32, **c)
    if kind == "mistral":
        return tf.MistralConfig(num_hidden_layers=4, head_dim=32, sliding_window=64, **c)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(num_hidden_layers=4, head_dim=32, sliding_window=64,
                                   layer_types=["sliding_attention", "full_attention"] * 2, **c)
    if kind == "gemma2":
        return tf.Gemma2Config(num_hidden_layers=4, head_dim=32, sliding_window=64, **c)
    mamba = dict(mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=64)
    if kind == "bamba":
        return tf.BambaConfig(num_hidden_layers=5, attn_layer_indices=[1, 4], **mamba, **c)
    if kind == "falcon_h1":
        return tf.FalconH1Config(num_hidden_layers=3, head_dim=32, mamba_d_ssm=512, **mamba, **c)
    if kind == "nemotron_h":
        return tf.NemotronHConfig(num_hidden_layers=4, hybrid_override_pattern="M*MM", head_dim=32,
                                  mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=16,
                                  conv_kernel=4, expand=2, chunk_size=64, **c)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(
            num_hidden_layers=4, head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
            mlp_only_layers=[], **c)
    if kind == "jamba":
        return tf.JambaConfig(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
                              expert_layer_period=4, expert_layer_offset=1, num_experts=1,
                              num_experts_per_tok=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=16, use_mamba_kernels=False, **c)
    raise ValueError(kind)


def build_model(tf, config, dtype, seed):
    import torch
    last = None
    for attn in ("sdpa", "eager"):
        for on_gpu in (True, False):     # initialised on the GPU (fast), else on the CPU
            try:
                torch.manual_seed(seed)
                if on_gpu:
                    with torch.device("cuda"):
                        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
                else:
                    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
                return model.to(device="cuda", dtype=dtype).eval()
            except Exception as e:
                last = e
    raise last


def slow_ssm(model):
    """Mamba-style layers with a slowly decaying state (per-step decay
    exp(-softplus(dt_bias) * exp(A_log)) of about 0.997 .. 0.96 instead of the
    default init's 0.27 .. 0), so that the state at a chunk boundary carries
    the prompt's context far into the suffix, and restoring the wrong one
    shows. Returns the number of layers changed."""
    import torch
    n = 0
    for m in model.modules():
        a, dt = getattr(m, "A_log", None), getattr(m, "dt_bias", None)
        if isinstance(a, torch.nn.Parameter) and isinstance(dt, torch.nn.Parameter) and a.dim() == 1:
            a.copy_(torch.log(torch.linspace(0.02, 0.3, a.numel(), device=a.device, dtype=a.dtype)))
            dt.fill_(-2.0)
            n += 1
    return n


def probe_hybrids(tf, HFEngine, names):
    """Which hybrid configs build, run on CUDA and expose recurrent states in
    their cache; whether their torch path continues a multi-token forward
    from a cached state. Returns [(name, chunk_ok)] of the usable ones."""
    import torch
    usable = []
    for name in names:
        try:
            model = build_model(tf, model_config(tf, name), torch.float32, 1234)
            eng = HFEngine(model)
            kinds = [L for L in eng.layers if L.states]
            if not kinds:
                raise RuntimeError("no recurrent state found in %s:\n%s" % (eng.cache_type,
                                                                            eng.cache_description))
            chunk, step = eng.continuation_check()
            ok = chunk < 1e-3
            print("  hybrid %-10s runs: %s (cache %s); C+C through the cache vs one forward: rel. max "
                  "|diff| %.2g (%s); token by token: %.2g" % (
                      name, type(model).__name__, eng.cache_type, chunk,
                      "continues from the state" if ok else "does NOT continue from the state", step))
            usable.append((name, ok))
            del eng, model
        except Exception as e:
            msg = str(e).strip().splitlines()
            print("  hybrid %-10s fails: %s: %s" % (name, type(e).__name__, msg[0] if msg else ""))
            for line in (msg[1:12] + traceback.format_exc().splitlines()[-14:]):
                print("      " + line)
        torch.cuda.empty_cache()
    return usable


def probe_sliding(tf, HFEngine, names):
    """The first of names whose model's own cache keeps a sliding window (its
    KV shorter than the sequence) in some layers."""
    import torch
    for name in names:
        try:
            model = build_model(tf, model_config(tf, name), torch.float32, 1234)
            eng = HFEngine(model)
            win = [L.i for L in eng.layers if L.kv == "window"]
            print("  sliding %-8s %s: cache %s, window layers %s" % (name, type(model).__name__,
                                                                     eng.cache_type, win or "none"))
            if win:
                return name
        except Exception as e:
            print("  sliding %-8s fails: %s: %s" % (name, type(e).__name__, str(e).splitlines()[:1]))
            for line in traceback.format_exc().splitlines()[-10:]:
                print("      " + line)
        torch.cuda.empty_cache()
    return None


def dump_sources(tf, dest):
    import tarfile
    root = os.path.dirname(tf.__file__)
    files = ["cache_utils.py", "masking_utils.py", "integrations/sdpa_attention.py"]
    for m in ("llama", "mistral", "gemma2", "bamba", "nemotron_h", "falcon_h1", "qwen3_next", "jamba",
              "mamba2"):
        files += ["models/%s/modeling_%s.py" % (m, m), "models/%s/configuration_%s.py" % (m, m)]
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, "hf-src.tar.gz")
    with tarfile.open(path, "w:gz") as t:
        for f in files:
            if os.path.exists(os.path.join(root, f)):
                t.add(os.path.join(root, f), arcname=f)
    print("transformers sources: %s" % path)


# ---- the scenario ------------------------------------------------------------------------------

class Scenario:
    def __init__(self, label, model, srv, ranks, step_mode, seed):
        import torch

        import kvside
        from hf_engine import HFEngine
        self.label, self.model, self.srv, self.ranks = label, model, srv, ranks
        self.eng = HFEngine(model, tokens_per_block=16, blocks_per_chunk=2, num_blocks=64, num_slots=24,
                            step_mode=step_mode)
        self.groups, self.C = self.eng.groups, self.eng.C
        self.ns = "%s-%s:%d" % (NS_BASE, label, seed)
        self.engine_name = "e2e-gpu-" + label
        n, C, V = PREFIX_CHUNKS, self.C, model.config.vocab_size
        g = torch.Generator().manual_seed(7)
        self.A = torch.randint(0, V, (PROMPT_CHUNKS * C + TAIL,), generator=g).tolist()
        suffix = torch.randint(0, V, (SUFFIX,), generator=g).tolist()
        if suffix[0] == self.A[n * C]:
            suffix[0] = (suffix[0] + 1) % V
        self.B = self.A[:n * C] + suffix
        self.keys_A = kvside.chunk_keys(self.ns, self.A, C)
        self.keys_B = kvside.chunk_keys(self.ns, self.B, C)
        check(len(self.keys_A) == PROMPT_CHUNKS, "keys of A")
        check(self.keys_B[:n] == self.keys_A[:n] and self.keys_B[n] != self.keys_A[n], "keys of B")
        self.seed = 10
        self.results = {}

    def describe(self):
        e = self.eng
        print("[%s] %s, %s, cache %s, %s mode; layers: %s" % (
            self.label, type(self.model).__name__, str(next(self.model.parameters()).dtype),
            e.cache_type, "step" if e.step_mode else "chunk", "; ".join(map(repr, e.layers))))
        print("[%s] kvside groups (per rank): %s; chunk %d tokens" % (self.label, ", ".join(
            "%d %s%s (%d tensors, %s)" % (g.gid, g.kind, "" if g.window_chunks < 1 else
                                          " window_chunks %d" % g.window_chunks, len(g.tensors),
                                          "+".join("%s%s" % (t.name.split(".")[1], list(t.block_shape))
                                                   for t in g.tensors[:2]))
            for g in self.groups), self.C))
        print("[%s] the model's cache object after a forward: %s" % (
            self.label, self.eng.cache_description.replace("\n", "\n    ")))

    def connect(self, order=None):
        self.ranks.connect(self.srv.run, self.engine_name, self.ns, order)

    def fresh(self):
        self.seed += 1
        self.eng.begin(self.seed)
        self.eng.fill_random(self.seed)

    def store_a(self):
        eng = self.eng
        self.fresh()
        t0 = time.perf_counter()
        eng.prefill(self.A, page=True)
        t1 = time.perf_counter()
        eng.store(self.keys_A)
        t2 = time.perf_counter()
        self.stored = {(r, g.gid, k): eng.object_bytes(r, g.gid, k)
                       for r in range(eng.world) for g in self.groups for k in range(PROMPT_CHUNKS)}
        self.a_tables = {gid: list(t) for gid, t in eng.tables.items()}
        hits, _ = self.ranks.lookup(self.keys_A)
        check(hits == PROMPT_CHUNKS, "lookup of A after the store: %d hits" % hits)
        print("[%s] A: %d tokens prefilled (%.0f ms), %d objects stored in one job over %d rank processes "
              "(%.0f ms), %d bytes each rank" % (
                  self.label, len(self.A), (t1 - t0) * 1e3, len(self.stored), eng.world, (t2 - t1) * 1e3,
                  sum(len(v) for v in self.stored.values()) // eng.world))

    def reference(self):
        eng = self.eng
        self.fresh()
        n = PREFIX_CHUNKS
        self.ref_tokens, self.ref_logits = eng.generate(self.B, N_NEW, page=True, capture_at=n * self.C)
        self.t_ref = eng.prefill_seconds
        self.ref_cache, self.ref_meta = eng.captured, eng.captured_meta
        objs = eng.prefix_objects(n)
        bad = sorted(k for k, v in objs.items() if v != self.stored[k])
        check(not bad, "the reference's prefix objects differ from A's (non-deterministic prefill?): %s" % bad)
        print("[%s] reference: B (%d tokens) computed from scratch, prefill %.0f ms; its prefix objects "
              "equal A's; greedy: %s" % (self.label, len(self.B), self.t_ref * 1e3, self.ref_tokens))
        # the same from one forward of all of B (other kernels' summation order: close, not bit-equal)
        self.fresh()
        toks, logits = eng.generate(self.B, N_NEW, one_forward=True)
        self.one_forward = (toks == self.ref_tokens, float((logits - self.ref_logits).abs().max()))
        self.results["one"] = self.one_forward
        print("[%s] B recomputed in one forward instead of chunk steps: tokens identical: %s, max |logit diff| "
              "%.3g" % ((self.label,) + self.one_forward))

    def check_nothing_else_written(self, before, n):
        import torch
        eng = self.eng
        for r, pool in enumerate(eng.pools):
            want = before[r].clone()
            for g in self.groups:
                for k in paged_needed(g, n):
                    data, pos = self.stored[(r, g.gid, k)], 0
                    for off, size in pool.object_ranges(g.gid, eng.object_blocks(g.gid, k)):
                        want[off:off + size] = torch.frombuffer(bytearray(data[pos:pos + size]),
                                                                dtype=torch.uint8).to(want.device)
                        pos += size
            if not torch.equal(want, pool.flat):
                d = (want != pool.flat).nonzero()
                check(False, "rank %d: %d bytes differ from the expected image (first at %d)"
                      % (r, d.numel(), int(d[0])))

    def restored(self, tier):
        from hf_engine import same_tensors, sync
        eng, n = self.eng, PREFIX_CHUNKS
        self.fresh()
        sync(eng.dev)
        before = [p.flat.clone() for p in eng.pools]
        t0 = time.perf_counter()
        hits, tiers = eng.restore(self.keys_B)
        t1 = time.perf_counter()
        # a chunk's tier is l2 when an object of it that the hit needs is only in L2 (protocol.md:
        # lookup); chunks before a window that no group needs stay "l1"
        want = [tier if any(k in paged_needed(g, n) for g in self.groups) else "l1" for k in range(n)]
        check(hits == n and tiers == want, "lookup of B: %d hits %s, expected %d: %s" % (hits, tiers, n, want))
        objs = eng.prefix_objects(n)
        bad = sorted(k for k, v in objs.items() if v != self.stored[k])
        check(not bad, "restored objects differ from A's: %s" % bad)
        self.check_nothing_else_written(before, n)
        del before
        for g in self.groups:
            if g.is_attention and g.kind == "full":
                nb = n * g.blocks_per_chunk
                check(eng.tables[g.gid][:nb] != self.a_tables[g.gid][:nb], "the restore got A's block ids")
        t2 = time.perf_counter()
        eng.rebuild()
        t3 = time.perf_counter()
        bad = same_tensors(eng.cache_tensors(), self.ref_cache)
        check(not bad, "the rebuilt cache object differs from the reference's at the prefix boundary: %s"
              % bad)
        meta = eng.cache_meta()
        odd = sorted(k for k in set(meta) | set(self.ref_meta) if meta.get(k) != self.ref_meta.get(k))
        if odd:
            print("[%s] note: the rebuilt cache's attributes differ from the reference's: %s" % (
                self.label, ", ".join("%s %r/%r" % (k, meta.get(k), self.ref_meta.get(k)) for k in odd)))
        toks, logits = eng.generate(self.B, N_NEW, start=n * self.C)
        diff = float((logits - self.ref_logits).abs().max())
        needed = {g.gid: paged_needed(g, n) for g in self.groups}
        print("[%s] %s: %d chunks restored in %.0f ms (%d objects over %d ranks, byte-identical to A's, "
              "nothing else written; %s; tiers %s); model cache rebuilt (%s) in %.0f ms, byte-identical to the "
              "reference's; suffix of %d tokens %.0f ms (full recompute %.0f ms); tokens identical: %s; "
              "max |logit diff| over %d steps: %.3g" % (
                  self.label, tier.upper(), n, (t1 - t0) * 1e3, len(objs), eng.world,
                  ", ".join("%s chunks %s" % (g.kind, _span(needed[g.gid])) for g in self.groups),
                  "/".join(tiers), eng.rebuild_path, (t3 - t2) * 1e3, SUFFIX, eng.prefill_seconds * 1e3, self.t_ref * 1e3,
                  toks == self.ref_tokens, N_NEW, diff))
        self.results[tier] = (toks == self.ref_tokens, diff)
        check(toks == self.ref_tokens, "%s: tokens %s != reference %s" % (tier, toks, self.ref_tokens))

    def broken(self, label, tamper=None, order=None):
        eng, n = self.eng, PREFIX_CHUNKS
        if order:
            self.connect(order)
        try:
            self.fresh()
            eng.restore(self.keys_B)
            detail = tamper() if tamper else ""
            eng.rebuild()
            toks, logits = eng.generate(self.B, N_NEW, start=n * self.C)
        finally:
            if order:
                self.connect()
        n_diff = sum(a != b for a, b in zip(toks, self.ref_tokens))
        first = next((i for i, (a, b) in enumerate(zip(toks, self.ref_tokens)) if a != b), None)
        print("[%s] negative (%s)%s: %d of %d tokens differ (first at step %s), max |logit diff| %.3g" % (
            self.label, label, detail, n_diff, N_NEW, first, float((logits - self.ref_logits).abs().max())))
        self.results.setdefault("negative", []).append((label, n_diff))
        check(toks != self.ref_tokens, "negative check %s decoded the reference tokens" % label)

    def negatives(self):
        from hf_engine import RECURRENT_GID
        n, eng = PREFIX_CHUNKS, self.eng
        if RECURRENT_GID in eng.by_gid:
            def tamper():
                eng.restore_state(self.keys_B, n - 2)
                for r in range(eng.world):
                    check(eng.pools[r].object_bytes(RECURRENT_GID, [eng.restored_slot]) ==
                          self.stored[(r, RECURRENT_GID, n - 2)],
                          "rank %d: restore_state did not bring the state of chunk %d" % (r, n - 2))
                return " (states of chunk %d retrieved over those of chunk %d)" % (n - 2, n - 1)
            self.broken("state of chunk n-2", tamper)
        # two layers of one group registered in swapped order: each gets the other's KV / state
        for g in self.groups:
            names = [t.name for t in g.tensors]
            lay = sorted({x.split(".")[0] for x in names}, key=lambda x: int(x[1:]))
            if len(lay) < 2:
                continue
            a = [x for x in names if x.split(".")[0] == lay[0]]
            b = [x for x in names if x.split(".")[0] == lay[1]]
            swapped = b + a + [x for x in names if x not in a and x not in b]
            self.broken("%s of another layer" % ("KV" if g.is_attention else "state"), order={g.gid: swapped},
                        tamper=lambda g=g, sw=swapped: " (%s group registered as %s)" % (g.kind, ",".join(sw)))

    def run(self, restart_srv):
        self.describe()
        self.eng.attach(self.ranks, self.seed)
        self.connect()
        try:
            self.store_a()
            self.reference()
            self.restored("l1")
            self.negatives()
            # restart on the same L2: every stored object must be written first
            want = len(self.stored)
            st = self.srv.wait_stat(lambda s: s["l2_queue_depth"] == 0 and s["l2_writes_committed"] >= want)
            check(st["l2_writes_committed"] >= want, "L2 holds %d of %d objects"
                  % (st["l2_writes_committed"], want))
            self.ranks.disconnect()
            restart_srv()
            self.connect()
            print("[%s] server restarted on its L2 (%d objects written before the restart)"
                  % (self.label, st["l2_writes_committed"]))
            self.restored("l2")
            st = self.srv.wait_stat(lambda s: True)
            needed = self.eng.world * sum(len(paged_needed(g, PREFIX_CHUNKS)) for g in self.groups)
            check(st["l2_reads"] >= needed and st["l2_read_misses"] == 0,
                  "L2 reads %d (%d objects needed), misses %d" % (st["l2_reads"], needed,
                                                                 st["l2_read_misses"]))
        finally:
            self.ranks.disconnect()
            self.ranks.free_pools()


def paged_needed(g, n):
    import paged
    return paged.needed_chunks(g, n)


def _span(ks):
    return "%d..%d" % (ks[0], ks[-1]) if len(ks) > 1 else str(ks[0]) if ks else "none"


# ---- time to first token -------------------------------------------------------------------------

def ttft_model(tf):
    import torch
    torch.use_deterministic_algorithms(False)
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=16384, initializer_range=0.02, tie_word_embeddings=False)
    return build_model(tf, cfg, torch.bfloat16, 5)


def timing(model, ranks, server_bin, lengths, suffix=128, reps=5, T=16, B=16):
    import torch

    import kvside
    import paged
    from hf_engine import HFEngine, sync
    cfg = model.config
    C = T * B
    longest = max(lengths)
    eng = HFEngine(model, tokens_per_block=T, blocks_per_chunk=B, num_blocks=(longest + 2 * C) // T,
                   num_slots=2)
    per_token = sum(t.block_bytes for g in eng.groups for t in g.tensors) * eng.world // T
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    print("[ttft] %s %s, %d layers, %.2f B parameters; KV %d bytes/token; chunk %d tokens (%d blocks of %d); "
          "layers: %s" % (type(model).__name__, dtype, cfg.num_hidden_layers,
                          sum(p.numel() for p in model.parameters()) / 1e9, per_token, C, B, T, eng.layers[0]))
    srv = paged.LocalServer(server_bin, l2=False, l1_size="4G")
    ns = "%s-ttft:%d" % (NS_BASE, os.getpid())
    rows = []
    try:
        srv.start()
        eng.attach(ranks, 3)
        ranks.connect(srv.run, "e2e-gpu-ttft", ns)
        g = torch.Generator().manual_seed(11)
        A = torch.randint(0, cfg.vocab_size, (longest + 64,), generator=g).tolist()
        eng.begin(1)
        t0 = time.perf_counter()
        eng.prefill(A, page=True)
        sync(eng.dev)
        t1 = time.perf_counter()
        keys_A = kvside.chunk_keys(ns, A, C)
        eng.store(keys_A)
        t2 = time.perf_counter()
        print("[ttft] A: %d tokens prefilled in %d-token steps (%.0f ms), %d chunks stored in one job "
              "(%.0f ms, %.0f MB)" % (len(A), C, (t1 - t0) * 1e3, len(keys_A), (t2 - t1) * 1e3,
                                     len(keys_A) * C * per_token / 1e6))

        def sync_ms(t):
            sync(eng.dev)
            return (time.perf_counter() - t) * 1e3

        def one_token():
            eng.begin(2)
            sync(eng.dev)
            t = time.perf_counter()
            eng.forward([A[0]], 0)
            return sync_ms(t)

        floor = statistics.median([one_token() for _ in range(6)][1:])
        print("[ttft] one forward of 1 token (the model code's fixed cost per forward): %.1f ms" % floor)

        for L in lengths:
            new = torch.randint(0, cfg.vocab_size, (suffix,), generator=g).tolist()
            Bp = A[:L] + new
            keys_B = kvside.chunk_keys(ns, Bp, C)
            n = L // C

            def one_forward():
                eng.begin(2)
                sync(eng.dev)
                t = time.perf_counter()
                tok = int(eng.forward(Bp, 0).argmax())
                return tok, sync_ms(t)

            def chunked():
                eng.begin(2)
                sync(eng.dev)
                t = time.perf_counter()
                tok = int(eng.prefill(Bp, page=False).argmax())
                return tok, sync_ms(t)

            def restored():
                eng.begin(2)
                sync(eng.dev)
                t = time.perf_counter()
                hits, _ = eng.restore(keys_B)
                ta = sync_ms(t)
                eng.rebuild()
                tb = sync_ms(t)
                tok = int(eng.prefill(Bp, start=n * C, page=False).argmax())
                tc = sync_ms(t)
                check(hits == n, "ttft: %d hits, %d expected" % (hits, n))
                return tok, (ta, tb - ta, tc - tb, tc)

            for f in (one_forward, chunked, restored):     # warm-up
                f()
            r1 = [one_forward() for _ in range(reps)]
            r2 = [chunked() for _ in range(reps)]
            r3 = [restored() for _ in range(reps)]
            check(len({t for t, _ in r2 + r3}) == 1, "ttft: first tokens differ: restored %s, chunked "
                  "recompute %s" % ([t for t, _ in r3], [t for t, _ in r2]))
            med = statistics.median
            row = (n, len(Bp), med(x for _, x in r1), med(x for _, x in r2),
                   med(x[0] for _, x in r3), med(x[1] for _, x in r3), med(x[2] for _, x in r3),
                   med(x[3] for _, x in r3), n * C * per_token / 1e6)
            rows.append(row)
            print("[ttft] prefix %d tokens: %s" % (L, ", ".join("%.1f" % x for x in row[2:])))
        ranks.disconnect()
        ranks.free_pools()
    finally:
        srv.stop()
        srv.cleanup()
    print()
    print("Time to first token of B = prefix + %d new tokens (median of %d, after a warm-up; %s %s, "
          "TP %d rank processes):" % (suffix, reps, type(model).__name__, dtype, eng.world))
    print()
    print("| prefix tokens (chunks) | B tokens | recompute, one forward | recompute, %d-token steps | "
          "restore: lookup + retrieve | rebuild cache | suffix | restored TTFT | speed-up vs one forward | "
          "vs steps | KV restored |" % C)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, nb, a, b, c, d, e, f, mb in rows:
        print("| %d (%d) | %d | %.1f ms | %.1f ms | %.1f ms | %.1f ms | %.1f ms | %.1f ms | %.2fx | %.1fx | %.0f MB |"
              % (n * C, n, nb, a, b, c, d, e, f, a / f, b / f, mb))
    print()
    return rows


# ---- main --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,mistral,hybrid")
    ap.add_argument("--hybrid", default="")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--timing-lengths", default="2048,4096,8192,16384")
    ap.add_argument("--dump-src", default="")
    args = ap.parse_args()
    t_start = time.perf_counter()
    try:
        import torch
    except ImportError as e:
        print("SKIP: torch cannot be imported (%s)" % e)
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    try:
        import transformers as tf
    except ImportError as e:
        print("SKIP: transformers cannot be imported (%s)" % e)
        return 77
    import kvside
    if not kvside.cuda_available():
        print("SKIP: libkvside has no CUDA support or sees no device (%s)" % kvside.library())
        return 77
    server = os.environ.get("KVS_SERVER")
    if not server:
        print("KVS_SERVER not set", file=sys.stderr)
        return 2
    import paged
    from hf_engine import HFEngine
    from tp_ranks import RankGroup

    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    print("torch %s, transformers %s, %s, kvside library %s" % (
        torch.__version__, tf.__version__, torch.cuda.get_device_name(0), kvside.library()))
    import transformers.cache_utils as cu
    print("transformers.cache_utils: %s" % ", ".join(n for n in dir(cu) if n.endswith(("Cache", "Layer"))))
    if args.dump_src:
        dump_sources(tf, args.dump_src)

    models = [m for m in args.models.split(",") if m]
    plan, failures, summary = [], [], []
    for m in models:
        if m == "mistral":
            print("sliding-window candidates:")
            pick = probe_sliding(tf, HFEngine, ("mistral", "gemma3", "gemma2"))
            if pick is None:
                failures.append("sliding window: no candidate keeps a window in its cache")
            else:
                plan.append((pick, False))
            continue
        if m != "hybrid":
            plan.append((m, False))
            continue
        print("hybrid candidates (torch-only paths: no mamba-ssm / causal-conv1d / fla kernels installed):")
        usable = probe_hybrids(tf, HFEngine, [args.hybrid] if args.hybrid else HYBRIDS)
        pick = next((u for u in usable if u[1]), usable[0] if usable else None)
        if pick is None:
            failures.append("hybrid: no candidate runs")
            continue
        plan.append((pick[0], not pick[1]))

    srv = paged.LocalServer(server, l2=True, l1_size="1G", l2_size="1G")
    ranks = None
    try:
        srv.start()
        ranks = RankGroup(2)

        def restart():
            rc = srv.stop()
            check(rc == 0, "server exit status %d" % rc)
            srv.start()

        for i, (name, step) in enumerate(plan):
            try:
                if srv.proc is None or srv.proc.poll() is not None:
                    srv.start()
                model = build_model(tf, model_config(tf, name), torch.float32, 1000 + i)
                if name in HYBRIDS:
                    print("[%s] %d Mamba / linear-attention layers set to a slowly decaying state" % (
                        name, slow_ssm(model)))
                sc = Scenario(name, model, srv, ranks, step, 1000 + i)
                sc.run(restart)
                summary.append((name, sc.eng.cache_type, "step" if step else "chunk", sc.results))
            except Exception as e:
                tb = traceback.format_exc()
                print("[%s] FAILED: %s\n%s" % (name, e, tb if not isinstance(e, Failure) else ""))
                print("server log:\n" + srv.log()[-2000:])
                failures.append("%s: %s" % (name, str(e).splitlines()[0] if str(e) else type(e).__name__))
                summary.append((name, "", "step" if step else "chunk", {}))
                try:
                    ranks.disconnect()
                    ranks.free_pools()
                except Exception:
                    pass
            torch.cuda.empty_cache()
        srv.stop()
        if not args.no_timing:
            try:
                timing(ttft_model(tf), ranks, server, [int(x) for x in args.timing_lengths.split(",")])
            except Exception as e:
                print("[ttft] FAILED: %s\n%s" % (e, traceback.format_exc()))
                failures.append("ttft: %s" % str(e).splitlines()[0])
    finally:
        if ranks is not None:
            ranks.close()
        srv.cleanup()

    print("| model | cache class | prefill | L1: tokens identical, max abs logit diff | "
          "L2: tokens identical, max abs logit diff | negative checks (tokens differing of %d) | "
          "B in one forward vs chunk steps |" % N_NEW)
    print("|---|---|---|---|---|---|---|")
    for name, ctype, mode, res in summary:
        def cell(t):
            return "%s, %.3g" % ("yes" if res[t][0] else "NO", res[t][1]) if t in res else "-"
        neg = "; ".join("%s: %d" % x for x in res.get("negative", [])) or "-"
        print("| %s | %s | %s | %s | %s | %s | %s |" % (name, ctype, mode, cell("l1"), cell("l2"), neg, cell("one")))
    if failures:
        print("FAILED (%.1f s): %s" % (time.perf_counter() - t_start, "; ".join(failures)))
        return 1
    print("PASS: prefixes restored through kvside (L1 and L2) decode exactly as the full recompute on "
          "%s; the wrong state or another layer's KV does not (%.1f s)" % (
              ", ".join(n for n, _ in plan), time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
