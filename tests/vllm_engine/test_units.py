"""KvsideConnector's parts against the installed vLLM's own classes (no
engine): the API it implements (inspect against KVConnectorBase_V1 and
SupportsHMA; mypy on kvside.vllm with vLLM's types), the classification of vLLM's KV-cache spec classes, and the
scheduler half's non-blocking lookup against a real server that stops
answering (SIGSTOP). Run by run.sh with the virtual environment's python."""

import inspect
import os
import signal
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "worker", "python"))
sys.path.insert(0, HERE)
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: E402
from vllm.v1 import kv_cache_interface as K  # noqa: E402

import kvside  # noqa: E402
from kvside.vllm import KvsideConnector  # noqa: E402
from kvside.vllm.config import ConnectorConfig  # noqa: E402
from kvside.vllm.groups import group_infos  # noqa: E402
from kvside.vllm.meta import JobOp, KvsideConnectorMetadata  # noqa: E402
from kvside.vllm.scheduler import SchedulerSide  # noqa: E402
from kvside.vllm.worker import WorkerSide  # noqa: E402
from kvt_server import Server  # noqa: E402


class ApiTest(unittest.TestCase):
    """What vLLM calls exists on the connector with vLLM's signature."""

    def test_every_abstract_method_is_implemented(self):
        missing = sorted(n for n in getattr(KvsideConnector, "__abstractmethods__", ()))
        self.assertEqual(missing, [], "abstract methods left unimplemented")

    def test_overrides_match_vllm_signatures(self):
        mine = {n for n, v in vars(KvsideConnector).items() if not n.startswith("_")}
        checked = 0
        for name in sorted(mine):
            ref = getattr(base.KVConnectorBase_V1, name, None) or getattr(base.SupportsHMA, name, None)
            self.assertIsNotNone(ref, "%s is not part of vLLM's connector API (stale?)" % name)
            if isinstance(inspect.getattr_static(base.KVConnectorBase_V1, name, None), property):
                self.assertIsInstance(inspect.getattr_static(KvsideConnector, name), property, name)
                continue
            want = [p.name for p in inspect.signature(ref).parameters.values()]
            got = [p.name for p in inspect.signature(getattr(KvsideConnector, name)).parameters.values()]
            self.assertEqual(got, want, "%s: vLLM has %s" % (name, want))
            checked += 1
        self.assertGreaterEqual(checked, 15)

    def test_the_stand_ins_list_is_this_release(self):
        # tests/vllm checks the stand-in (used where vLLM cannot be
        # installed: the GPU machine) against vllm_api.txt
        import dump_api
        with open(os.path.join(ROOT, "tests", "vllm", "vllm_api.txt")) as f:
            self.assertEqual(f.read().splitlines(), dump_api.lines(),
                             "regenerate tests/vllm/vllm_api.txt with dump_api.py and update the stand-in")

    def test_types_check_against_this_vllm(self):
        import subprocess
        r = subprocess.run([sys.executable, "-m", "mypy", "--python-version", "3.11", "--follow-imports=silent",
                            "--ignore-missing-imports", "--cache-dir=/dev/null", "kvside/vllm/"],
                           cwd=os.path.join(ROOT, "worker", "python"), capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_failed_loads_are_reported_by_request(self):
        self.assertIn("failed_recving", base.KVConnectorTransferResults.__dataclass_fields__)


def attn(cls, **kw):
    return cls(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16, **kw)


def config(*specs, transfer=None):
    groups = [K.KVCacheGroupSpec(["l%d" % i], s) for i, s in enumerate(specs)]
    for i in (transfer or ()):
        groups[i].enable_kv_transfer = False
    return K.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


class GroupsTest(unittest.TestCase):
    """vLLM's spec classes, by isinstance: kept, skipped, or refused."""

    def kinds(self, *specs, **kw):
        return [(g.index, g.kind, g.window_chunks) for g in group_infos(config(*specs, **kw), 64)]

    def test_kept_kinds(self):
        mamba = K.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
        self.assertEqual(self.kinds(attn(K.FullAttentionSpec), attn(K.SlidingWindowSpec, sliding_window=100),
                                    mamba),
                         [(0, "full", -1), (1, "window", 2), (2, "recurrent", -1)])
        self.assertEqual(self.kinds(attn(K.MLAAttentionSpec)), [(0, "full", -1)])

    def test_uniform_wrapper_takes_its_members_kind(self):
        u = K.UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={
            "a": attn(K.SlidingWindowSpec, sliding_window=32), "b": attn(K.SlidingWindowSpec, sliding_window=32)})
        self.assertEqual(self.kinds(u), [(0, "window", 1)])

    def test_groups_vllm_keeps_out_are_skipped(self):
        ring = attn(K.CircularBufferSpec)
        self.assertEqual(self.kinds(attn(K.FullAttentionSpec), ring), [(0, "full", -1)])
        self.assertEqual(self.kinds(attn(K.FullAttentionSpec), attn(K.FullAttentionSpec), transfer=[0]),
                         [(1, "full", -1)])

    def test_unknown_kinds_are_refused_by_name(self):
        for spec in (attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=64),
                     attn(K.RSWASpec, rswa_window=64), attn(K.SinkFullAttentionSpec)):
            with self.assertRaisesRegex(ValueError, type(spec).__name__):
                group_infos(config(attn(K.FullAttentionSpec), spec), 64)

    def test_mamba_without_prefix_caching_is_refused(self):
        m = K.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="none")
        with self.assertRaisesRegex(ValueError, "mamba_cache_mode"):
            group_infos(config(m), 64)


class ConfigTest(unittest.TestCase):
    """What the connector reads from vLLM's configuration (vLLM 0.32's own
    ParallelConfig and KVCacheConfig)."""

    def test_context_and_pipeline_parallelism_refused(self):
        from vllm.config import ParallelConfig
        from kvside.vllm.connector import _check_parallelism
        _check_parallelism(ParallelConfig())
        for kw, name in (({"decode_context_parallel_size": 2}, "decode_context"),
                         ({"prefill_context_parallel_size": 2}, "prefill_context"),
                         ({"pipeline_parallel_size": 2}, "pipeline")):
            pc = ParallelConfig()
            for k, v in kw.items():
                object.__setattr__(pc, k, v)
            with self.assertRaisesRegex(ValueError, name):
                _check_parallelism(pc)

    def test_hash_block_size_is_the_one_vllm_resolved(self):
        from types import SimpleNamespace as NS
        from kvside.vllm.connector import _hash_block_size
        vc = NS(cache_config=NS(prefix_match_unit=None))
        kcc = config(attn(K.FullAttentionSpec))
        self.assertEqual(_hash_block_size(vc, kcc, [32]), 32)
        kcc.hash_block_size = 16  # vLLM's EngineCore resolved it (e.g. a finer prefix_match_unit)
        self.assertEqual(_hash_block_size(vc, kcc, [32]), 16)


class _Req:
    def __init__(self, rid, hashes, n_tokens):
        self.request_id, self.block_hashes, self.num_tokens = rid, hashes, n_tokens


class LookupTest(unittest.TestCase):
    """get_num_new_matched_tokens never waits on the server beyond
    lookup_wait_ms: while the answer is on its way it says None (vLLM asks
    again next step)."""

    def test_a_stopped_server_gets_none_then_the_answer(self):
        srv = Server(prefix="kvt-vllm-units-")
        srv.start()
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        cfg = ConnectorConfig.from_extra({"broker_dir": srv.run, "chunk_tokens": 32, "lookup_timeout_ms": 30000})
        groups = group_infos(config(attn(K.FullAttentionSpec)), 32)
        side = SchedulerSide(cfg, "vllm-units", "ns-units", 1, groups, 1, 32, True, "eager")
        self.addCleanup(side.close)
        req = _Req("r1", [os.urandom(32) for _ in range(4)], 4 * 32 + 1)
        self.assertEqual(side.get_num_new_matched_tokens(req, 0), (0, False), "nothing cached")
        # store chunks 0-1 through a worker session of the same namespace
        mem = kvside.HostMemory(16 * 4096)
        w = kvside.Client("vllm-units", "ns-units", rank=0, world=1, broker_dir=srv.run)
        self.addCleanup(w.close)
        w.register_memory([mem], groups=[kvside.Group(0, "attention", 32, 1, -1, 0)],
                          layers=[kvside.Layer(0, 0, 0, 16, 4096, 4096)])
        self.assertEqual(w.store(1, side._keys(side._reqs["r1"])[:2], [[1, 2]]), "open")
        w.complete(1)
        self.assertEqual(w.job_wait(1, timeout_ms=5000), "committed")
        side._reqs["r1"].lookup = None  # forget the cached "no hit"
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            answers = [side.get_num_new_matched_tokens(req, 0) for _ in range(3)]
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        self.assertEqual(answers, [(None, False)] * 3, "asked again while the server is stopped")
        got = None
        for _ in range(5000):  # steps of an engine loop, each waiting lookup_wait_ms at most
            got = side.get_num_new_matched_tokens(req, 0)
            if got[0] is not None:
                break
        self.assertEqual(got, (2 * 32, False), "two chunks hit once the server answers")
        self.assertEqual(side.stats["lookups"], 2, "one lookup was sent for the three asks")


class V2SavesTest(unittest.TestCase):
    """Under vLLM's V2 model runner, which writes newly allocated blocks
    before any connector hook of the next step, a store ends within the
    wait_for_save that issued it; under V1 it may run on (fenced where the
    blocks can be reused). The server's copies run 300 ms late
    (KVS_TEST_COPY_DELAY_MS), so a store still reading is seen."""

    def pending_after_save(self, v2):
        os.environ["KVS_TEST_COPY_DELAY_MS"] = "300"
        try:
            srv = Server(prefix="kvt-vllm-units-")
            srv.start()
        finally:
            del os.environ["KVS_TEST_COPY_DELAY_MS"]
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        cfg = ConnectorConfig.from_extra({"broker_dir": srv.run, "chunk_tokens": 32})
        kcc = config(attn(K.FullAttentionSpec))
        groups = group_infos(kcc, 32)
        w = WorkerSide(cfg, "vllm-v2", "ns-v2", 0, 1, groups, 16, [g.kv_cache_spec for g in kcc.kv_cache_groups],
                       saves_end_in_step=v2)
        self.addCleanup(w.close)
        cache = torch.zeros(16, 2, 32, 64, dtype=torch.float16)  # [nb, H, bs, 2D], anonymous as vLLM's CPU caches
        w.register({"l0": cache}, {"l0": 0})
        import array
        op = JobOp("r1", 77, os.urandom(32) * 2, [array.array("q", [3, 4])])
        meta = KvsideConnectorMetadata(stores=[op])
        w.wait_for_save(meta)
        busy = w.pending_work()
        w.shutdown()
        return busy

    def test_v2_store_ends_in_its_step(self):
        self.assertFalse(self.pending_after_save(True))

    def test_v1_store_runs_on(self):  # the control: the delay is real
        self.assertTrue(self.pending_after_save(False))


class LateLoadTest(unittest.TestCase):
    """A load whose retrieve gets no answer within load_timeout_ms (300 ms)
    while the server's copies into its blocks are held 1.5 s
    (KVS_TEST_COPY_DELAY_MS): the connector reports it failed only once the
    job ended (protocol.md 9.7), so vLLM never recomputes into blocks the
    server still writes. Checked by poisoning the destination blocks as soon
    as the load is reported and re-reading them after the held copies could
    have landed. Before the change the report came at 300 ms and the late
    copy overwrote the poison."""

    HOLD_MS = 1500

    def setUp(self):
        os.environ["KVS_TEST_COPY_DELAY_MS"] = str(self.HOLD_MS)
        try:
            self.srv = Server(prefix="kvt-vllm-late-", ttl_ms=8000)
            self.srv.start()
        finally:
            del os.environ["KVS_TEST_COPY_DELAY_MS"]
        self.addCleanup(self.srv.cleanup)
        self.addCleanup(self.srv.stop)
        cfg = ConnectorConfig.from_extra({"broker_dir": self.srv.run, "chunk_tokens": 32, "load_timeout_ms": 300})
        kcc = config(attn(K.FullAttentionSpec))
        self.w = WorkerSide(cfg, "vllm-late", "ns-late", 0, 1, group_infos(kcc, 32), 16,
                            [g.kv_cache_spec for g in kcc.kv_cache_groups])
        self.addCleanup(self.w.close)
        self.cache = torch.zeros(16, 2, 32, 64, dtype=torch.float16)
        self.w.register({"l0": self.cache}, {"l0": 0})
        import array
        self.keys = os.urandom(32) * 2
        self.cache[3:5] = 7.0
        self.w.wait_for_save(KvsideConnectorMetadata(stores=[JobOp("s", 11, self.keys, [array.array("q", [3, 4])])]))
        for _ in range(200):  # the held store ends (job_done) within ~2 holds
            if not self.w.pending_work():
                break
            time.sleep(0.05)
        self.assertFalse(self.w.pending_work(), "the store did not end")
        self.load = JobOp("r", 12, self.keys, [array.array("q", [8, 9])])

    def poisoned_after(self):
        """Poisons the destinations at once, waits past the held copies, and
        returns whether the poison is still all there."""
        self.cache[8:10] = -1.0
        time.sleep(2 * self.HOLD_MS / 1000.0)
        return bool((self.cache[8:10] == -1.0).all())

    def test_sync_load_waits_for_the_job_end(self):
        self.load.sync = True
        self.w.start_load_kv(KvsideConnectorMetadata(loads=[self.load]))
        self.assertEqual(self.w.get_block_ids_with_load_errors(), {8, 9}, "reported for recompute")
        self.assertTrue(self.poisoned_after(), "the server wrote the blocks after the load was reported")
        self.assertEqual(self.w.stats["load_errors"], 1)

    def test_async_load_is_reported_after_the_job_end(self):
        self.w.start_load_kv(KvsideConnectorMetadata(loads=[self.load]))
        got = set()
        for _ in range(400):  # the engine's steps
            _, got, _ = self.w.get_finished(None, ())
            if got:
                break
            time.sleep(0.025)
        self.assertEqual(got, {"r"})
        self.assertEqual(self.w.get_block_ids_with_load_errors(), {8, 9})
        self.assertTrue(self.poisoned_after(), "the server wrote the blocks after the load was reported")
        self.assertFalse(self.w.pending_work())

    def test_control_the_copy_lands_late(self):
        # without the connector's wait the held copy lands after 300 ms:
        # the poison is overwritten (else the cases above prove nothing)
        p = self.w.client.retrieve_async(self.load.job, self.load.keys, self.load.blocks, timeout_ms=300)
        self.w.client.complete_async(self.load.job, True, timeout_ms=300)
        p.wait(5)
        self.assertFalse(self.poisoned_after(), "the held copy did not land after the local time-out")


if __name__ == "__main__":
    unittest.main(verbosity=2)
