#!/usr/bin/python3
"""Prefix caching proven on model code, CPU version (issue 14).

A tiny hybrid model (tiny_model.py: full attention, sliding-window attention,
a gated linear recurrence; random weights, fixed seed, float32) runs in a
paged engine (engine.py) whose KV cache and recurrent state live in kvside
host memory, TP 2 (two rank clients, each holding half the KV heads and half
the recurrent channels). Against a real kvside-server with L2:

1. prompt A (6 chunks + a partial one) is prefilled in chunk steps, the state
   snapshotted at every chunk end, and its 6 chunks are stored in one job;
2. prompt B = A's first 4 chunks + a new suffix is computed from scratch by
   an engine without kvside and greedy-decodes 32 tokens (the reference);
3. a fresh engine (other block ids, memory full of random bytes) looks B up,
   retrieves the prefix (full-attention blocks, the window's 2 trailing
   chunks, the state at the end of chunk 3) and computes only the suffix: the
   restored bytes equal A's, the 32 tokens equal the reference's;
4. the test can fail: the state of chunk 2 instead of chunk 3, or a
   registration whose full-attention layers are listed in another order (each
   layer gets another layer's KV), give other tokens;
5. the server is restarted on the same L2 directory and step 3 is repeated:
   the prefix now comes from L2.

Environment: KVS_SERVER, KVSIDE_LIB, PYTHONPATH holding worker/python. Exits
77 (skipped) when torch cannot be imported.
"""

import os
import sys
import time

try:
    import torch
except ImportError as e:
    print("SKIP: torch cannot be imported (%s)" % e)
    sys.exit(77)

import kvside  # noqa: E402
import paged  # noqa: E402
from engine import FULL_GID, RECURRENT_GID, Engine, layout  # noqa: E402
from tiny_model import TinyConfig, TinyModel  # noqa: E402

NS = "e2e-tiny:1234"
PROMPT_CHUNKS, TAIL = 6, 8        # prompt A: 6 chunks + 8 tokens (no key for those)
PREFIX_CHUNKS, SUFFIX = 4, 40     # prompt B: A's first 4 chunks + 40 new tokens
N_NEW = 32


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


class Scenario:
    def __init__(self, server):
        self.srv = server
        self.cfg = TinyConfig()
        self.model = TinyModel(self.cfg)
        self.groups = layout(self.cfg)
        self.C = self.groups[0].chunk_tokens
        self.window_chunks = next(g.window_chunks for g in self.groups if g.kind == paged.WINDOW)
        n, C = PREFIX_CHUNKS, self.C
        g = torch.Generator().manual_seed(7)
        self.A = torch.randint(0, self.cfg.vocab, (PROMPT_CHUNKS * C + TAIL,), generator=g).tolist()
        suffix = torch.randint(0, self.cfg.vocab, (SUFFIX,), generator=g).tolist()
        if suffix[0] == self.A[n * C]:
            suffix[0] = (suffix[0] + 1) % self.cfg.vocab
        self.B = self.A[:n * C] + suffix
        self.keys_A = kvside.chunk_keys(NS, self.A, C)
        self.keys_B = kvside.chunk_keys(NS, self.B, C)
        check(len(self.keys_A) == PROMPT_CHUNKS, "keys of A")
        check(self.keys_B[:n] == self.keys_A[:n] and self.keys_B[n] != self.keys_A[n], "keys of B")
        self.seed = 10

    def engine(self, label, **kw):
        self.seed += 1
        return Engine(self.model, self.srv.run, NS, name="e2e-" + label, seed=self.seed, **kw)

    def store_a(self):
        eng = self.engine("A")
        try:
            t0 = time.perf_counter()
            eng.prefill(self.A, snapshot=True)
            t1 = time.perf_counter()
            eng.store(self.keys_A)
            t2 = time.perf_counter()
            self.stored = {(r, g.gid, k): eng.object_bytes(r, g.gid, k)
                           for r in range(self.cfg.tp) for g in self.groups
                           for k in range(PROMPT_CHUNKS)}
            self.a_blocks = list(eng.tables[FULL_GID])
            hit = eng.conn.lookup(self.keys_A)
            check(hit.hits == PROMPT_CHUNKS, "lookup of A after the store: %s" % (hit,))
        finally:
            eng.close()
        print("A: %d tokens prefilled in %d chunk steps (%.0f ms), %d objects stored in one job over "
              "%d ranks (%.0f ms), %d bytes each rank" % (
                  len(self.A), PROMPT_CHUNKS + 1, (t1 - t0) * 1e3, len(self.stored), self.cfg.tp,
                  (t2 - t1) * 1e3, sum(len(v) for v in self.stored.values()) // self.cfg.tp))

    def reference(self):
        ref = Engine(self.model, seed=2)
        try:
            self.ref_tokens, self.ref_logits = ref.generate(self.B, N_NEW, snapshot=True)
            self.t_ref_prefill = ref.prefill_seconds
            # prefill is deterministic: the reference computed A's prefix bytes exactly
            objs = ref.prefix_objects(PREFIX_CHUNKS)
            check(all(v == self.stored[k] for k, v in objs.items()),
                  "the reference's prefix differs from A's (non-deterministic prefill?)")
        finally:
            ref.close()
        print("reference: B (%d tokens) recomputed from scratch, prefill %.0f ms; greedy: %s" % (
            len(self.B), self.t_ref_prefill * 1e3, self.ref_tokens))

    def restored(self, tier):
        """Fresh engine, prefix from kvside, suffix computed: same tokens."""
        n = PREFIX_CHUNKS
        eng = self.engine("B-" + tier)
        try:
            before = [p.raw() for p in eng.pools]
            t0 = time.perf_counter()
            hit = eng.restore(self.keys_B)
            t1 = time.perf_counter()
            check(hit.hits == n and hit.tiers == [tier] * n,
                  "lookup of B: %s, expected %d hits from %s" % (hit, n, tier))
            objs = eng.prefix_objects(n)
            bad = sorted(k for k, v in objs.items() if v != self.stored[k])
            check(not bad, "restored objects differ from A's: %s" % bad)
            self.check_nothing_else_written(eng, before, n)
            nb = n * self.groups[0].blocks_per_chunk
            check(eng.tables[FULL_GID][:nb] != self.a_blocks[:nb], "the fresh engine got A's block ids")
            toks, logits = eng.generate(self.B, N_NEW, start=n * self.C)
            t_suffix = eng.prefill_seconds
        finally:
            eng.close()
        diff = float((logits - self.ref_logits).abs().max())
        print("%s: %d chunks restored in %.0f ms (%d objects over %d ranks, byte-identical to A's: "
              "full attention chunks 0..%d, window chunks %d..%d, state at the end of chunk %d); "
              "suffix of %d tokens prefilled in %.0f ms (full recompute of B: %.0f ms); "
              "tokens identical: %s; max |logit diff| over %d steps: %.3g" % (
                  tier.upper(), n, (t1 - t0) * 1e3, len(objs), self.cfg.tp, n - 1,
                  max(0, n - self.window_chunks), n - 1, n - 1, SUFFIX, t_suffix * 1e3,
                  self.t_ref_prefill * 1e3, toks == self.ref_tokens, N_NEW, diff))
        check(toks == self.ref_tokens, "%s: tokens %s != reference %s" % (tier, toks, self.ref_tokens))
        return diff

    def check_nothing_else_written(self, eng, before, n):
        """Each rank's memory now equals its garbage from before the retrieve
        with exactly A's objects written into the destination blocks: no other
        byte (stride padding, other blocks, other slots) was touched."""
        for r, pool in enumerate(eng.pools):
            want = bytearray(before[r])
            for g in self.groups:
                for k in paged.needed_chunks(g, n):
                    data, pos = self.stored[(r, g.gid, k)], 0
                    for off, size in pool.object_ranges(g.gid, eng.object_blocks(g.gid, k)):
                        want[off:off + size] = data[pos:pos + size]
                        pos += size
            now = pool.raw()
            if now != want:
                diff = sum(1 for i in range(0, len(now), 4096) if now[i:i + 4096] != want[i:i + 4096])
                check(False, "rank %d: %d pages differ from the expected image" % (r, diff))

    def broken(self, label, tamper=None, **kw):
        """A restore gone wrong: must decode other tokens than the reference."""
        n = PREFIX_CHUNKS
        eng = self.engine("neg-" + label, **kw)
        try:
            eng.restore(self.keys_B)
            detail = tamper(eng) if tamper else ""
            toks, logits = eng.generate(self.B, N_NEW, start=n * self.C)
        finally:
            eng.close()
        n_diff = sum(a != b for a, b in zip(toks, self.ref_tokens))
        first = next((i for i, (a, b) in enumerate(zip(toks, self.ref_tokens)) if a != b), None)
        print("negative (%s)%s: %d of %d tokens differ (first at step %s), max |logit diff| %.3g" % (
            label, detail, n_diff, N_NEW, first, float((logits - self.ref_logits).abs().max())))
        check(toks != self.ref_tokens, "negative check %s decoded the reference tokens" % label)


def main():
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    server = os.environ.get("KVS_SERVER")
    if not server:
        print("KVS_SERVER not set", file=sys.stderr)
        return 2
    print("torch %s, kvside library %s" % (torch.__version__, kvside.library()))
    srv = paged.LocalServer(server, l2=True)
    try:
        srv.start()
        sc = Scenario(srv)
        print("model: layers %s, %d heads (%d per rank), window %d tokens, chunk %d tokens (%d blocks "
              "of %d); groups: %s" % (
                  "/".join(sc.cfg.layers), sc.cfg.n_heads, sc.cfg.heads_per_rank, sc.cfg.window, sc.C,
                  sc.groups[0].blocks_per_chunk, sc.groups[0].tokens_per_block,
                  ", ".join("%d %s (%d tensors)" % (g.gid, g.kind, len(g.tensors)) for g in sc.groups)))
        sc.store_a()
        sc.reference()
        sc.restored("l1")
        n = PREFIX_CHUNKS

        def state_of_chunk(chunk):
            def tamper(eng):
                eng.restore_state(sc.keys_B, chunk)
                for r, pool in enumerate(eng.pools):
                    check(pool.object_bytes(RECURRENT_GID, [eng.state_slot]) ==
                          sc.stored[(r, RECURRENT_GID, chunk)],
                          "rank %d: restore_state did not bring the state of chunk %d" % (r, chunk))
                return " (state of chunk %d retrieved over the one of chunk %d)" % (chunk, n - 1)
            return tamper

        sc.broken("state of chunk n-2", state_of_chunk(n - 2))
        full = next(g for g in sc.groups if g.gid == FULL_GID)
        names = [t.name for t in full.tensors]
        swapped = names[2:4] + names[0:2] + names[4:]
        sc.broken("KV of another layer", register_order={FULL_GID: swapped},
                  tamper=lambda eng: " (full-attention layers registered as %s)" % ",".join(swapped))

        # restart on the same L2: every stored object must be written first
        want = len(sc.stored)
        st = srv.wait_stat(lambda s: s["l2_queue_depth"] == 0 and s["l2_writes_committed"] >= want)
        check(st["l2_writes_committed"] >= want,
              "L2 holds %d of %d objects" % (st["l2_writes_committed"], want))
        rc = srv.stop()
        check(rc == 0, "server exit status %d" % rc)
        srv.start()
        print("server restarted on its L2 (%d objects written before the restart)"
              % st["l2_writes_committed"])
        sc.restored("l2")
        st = srv.wait_stat(lambda s: True)
        needed = sc.cfg.tp * sum(len(paged.needed_chunks(g, n)) for g in sc.groups)
        check(st["l2_reads"] >= needed and st["l2_read_misses"] == 0,
              "L2 reads %d (%d objects needed), misses %d" % (st["l2_reads"], needed, st["l2_read_misses"]))
        print("L2 reads after the restart: %d (promotions %d)" % (st["l2_reads"], st["l2_promotions"]))
        rc = srv.stop()
        check(rc == 0, "server exit status %d" % rc)
    except Failure as e:
        print("FAILED: %s\nserver log:\n%s" % (e, srv.log()))
        return 1
    except BaseException:
        print("server log:\n" + srv.log())
        raise
    finally:
        srv.cleanup()
    print("PASS: prefix restored through kvside (L1 and L2) decodes exactly as the full recompute; "
          "the wrong state or another layer's KV does not (%.1f s)" % (time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
