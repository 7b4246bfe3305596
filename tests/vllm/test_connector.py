#!/usr/bin/python3
"""KvsideConnector (worker/python/kvside/vllm) driven in vLLM's own call order
by tests/vllm/engine.py: one scheduler process plus one process per TP rank
(2), a real kvside-server, KV caches in kvside host memory viewed as torch
tensors in vLLM's layouts, and the stand-in ``vllm`` package
(tests/vllm/stub). Every generated token is compared with MockModel.generate
(the same model without an engine or a connector), and every prefix a
request starts from is checked byte for byte by the workers; a load error the
connector reports excuses the bytes of its blocks (vLLM recomputes them).

Cases: the engine alone matches the model (full attention and a hybrid model,
with a preemption); the connector's API against tests/vllm/vllm_api.txt;
2 TP ranks, prompts sharing prefixes, stored then hit and loaded byte-exact
(also by a second engine); a hybrid model (full attention + sliding window +
Mamba "align") restored at chunk boundaries; a preemption while a save of the
request may be in flight, its blocks reused at once; the server SIGKILLed and
restarted mid-run (with L2); an object evicted (admin clear) between lookup
and load. Debian's python3 with python3-torch and python3-numpy; exit 77
when torch cannot be imported.

Environment: KVSIDE_LIB, KVS_SERVER, PYTHONPATH holding worker/python,
tests/vllm/stub, tests/vllm and tests/python; PYTHONHASHSEED set (the
stand-in seeds vLLM's NONE_HASH from it). KVT_LOG_LEVEL (e.g. INFO) raises
the processes' log level; KVT_KEEP_LOGS=1 keeps their logs; KVT_VERBOSE=1
prints each phase's per-request record, connector stats and call timings;
KVT_CONNECTOR=module:Class drives another connector class. KVT_DEVICE=cuda
puts every rank's KV caches on the GPU (KVT_CUDA_ALLOC=torch|kvside,
KVT_CUDA_DELAY_US, the control KVT_CUDA_WRITE_STREAM=side: engine.py's
docstring); tests/gpu/gpu-run.sh remote-vllm runs the suite that way.
"""

import inspect
import os
import re
import shutil
import sys
import tempfile
import time
import unittest

try:
    import torch  # noqa: F401
except ImportError as e:
    print("SKIP: torch cannot be imported (%s)" % e)
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "stub"), HERE, os.path.join(HERE, "..", "python"),
          os.path.join(HERE, "..", "..", "worker", "python")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("PYTHONHASHSEED", "0")

import kvside  # noqa: E402
from kvt_server import Server as _Server  # noqa: E402
import engine as E  # noqa: E402

SERVER = os.environ.get("KVS_SERVER")
# KVT_CONNECTOR=module:Class runs the cases against another connector class
CONNECTOR = tuple(os.environ.get("KVT_CONNECTOR", "kvside.vllm:KvsideConnector").split(":", 1))
API_FILE = os.path.join(HERE, "vllm_api.txt")

FULL_MODEL = dict(groups=[E.GroupDef("full", 16, 3, num_kv_heads=2, head_size=8)], num_blocks=256,
                  max_num_batched_tokens=96)
# hybrid: pages unified at 2048 B (32 x 2 heads x 16 x 2 B; 16 x 4 heads x 16 x 2 B; Mamba padded)
HYBRID_MODEL = dict(groups=[E.GroupDef("full", 32, 2, num_kv_heads=2, head_size=8),
                            E.GroupDef("swa", 16, 2, num_kv_heads=4, head_size=8, sliding_window=40),
                            E.GroupDef("mamba", 32, 2)],
                    num_blocks=160, max_num_batched_tokens=64)


def prompt(seed, n, base=None):
    """n tokens: base (a shared prefix) then a pseudo-random tail."""
    toks = list(base or [])
    x = seed * 7919 + 17
    while len(toks) < n:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        toks.append(x % 50000)
    return toks[:n]


def Server(l2=False):
    """kvside-server in a private run directory (tests/python/kvt_server.py)."""
    return _Server(l2=l2, prefix="kvt-vllm-srv-")


def extra_config(srv, **kw):
    cfg = {"broker_dir": srv.run, "chunk_tokens": 64, "timeout_ms": 3000, "open_timeout_ms": 1000,
           "reconnect_ms": 300, "lookup_timeout_ms": 1000, "load_timeout_ms": 3000, "save_wait_ms": 5000,
           "pin_ms": 10000, "store": "eager", "load": True}
    cfg.update(kw)
    return cfg


class Base(unittest.TestCase):
    def setUp(self):
        self.closers = []
        self.engines = []
        self.servers = []

    def tearDown(self):
        for eng in reversed(self.engines):
            try:
                errs = eng.close()
                if errs:
                    print("engine shutdown errors: %s" % errs, file=sys.stderr)
            except Exception as e:  # reported; the test already has its verdict
                print("engine close: %s" % e, file=sys.stderr)
            if not os.environ.get("KVT_KEEP_LOGS"):
                shutil.rmtree(eng.log_dir, ignore_errors=True)
            else:
                print("logs kept in %s" % eng.log_dir, file=sys.stderr)
        for c in reversed(self.closers):
            c()
        for s in self.servers:
            s.stop()
            s.cleanup()

    def server(self, **kw):
        s = Server(**kw)
        self.servers.append(s)
        s.start()
        return s

    def engine(self, model, connector=CONNECTOR, extra=None, engine_id="engine-0", **kw):
        spec = E.ModelSpec(**dict(model, **kw))
        log_dir = tempfile.mkdtemp(prefix="kvt-vllm-")
        try:
            eng = E.EngineHandle(spec, connector, extra, engine_id=engine_id, log_dir=log_dir)
        except BaseException:
            if not os.environ.get("KVT_KEEP_LOGS"):
                shutil.rmtree(log_dir, ignore_errors=True)
            raise
        self.engines.append(eng)
        return eng, E.MockModel(spec)

    def assert_outputs(self, res, model, reqs):
        """Generated tokens equal the model's, and no prefix a request started
        from held a wrong byte (other than blocks reported as load errors)."""
        if os.environ.get("KVT_VERBOSE"):
            print("\n%s: steps %d, log %s, stats %s\n  timing %s" % (self.id(), res["steps"], res["log"],
                  res["stats"], res["timing"]), file=sys.stderr)
            for r in reqs:
                print("  %s: %s" % (r["id"], res["info"][r["id"]]), file=sys.stderr)
        tail = "\n".join(e.log_tail(15) for e in self.engines) + "".join(
            "\n---- server log\n" + s.log_tail(15) for s in self.servers)
        self.assertEqual(res["checks"], [], "bytes of a restored prefix differ: %s\nengine log: %s\n%s"
                         % (res["checks"][:5], res["log"][-10:], tail))
        for r in reqs:
            want = model.generate(r["prompt"], r["max_tokens"])
            self.assertEqual(res["tokens"][r["id"]], want, "request %s generated other tokens (info %s, "
                             "engine log %s)\n%s" % (r["id"], res["info"][r["id"]], res["log"][-10:], tail))

    @staticmethod
    def ext(res, rid):
        return sum(e[1] for e in res["info"][rid]["ext"])


# ---------------------------------------------------------------------------------------------


class EngineAlone(Base):
    def test_engine_matches_the_model(self):
        """No connector: the engine's tokens are the model's (full attention
        with chunked prefill; hybrid with sliding window, Mamba align and a
        preemption); the reference every other case compares with."""
        eng, model = self.engine(FULL_MODEL, connector=None, runner="v2")
        reqs = [{"id": "a", "prompt": prompt(1, 200), "max_tokens": 6},
                {"id": "b", "prompt": prompt(2, 170), "max_tokens": 5, "arrive": 1}]
        self.assert_outputs(eng.run(reqs, preempt=[{"req": "a", "computed": 96}]), model, reqs)
        eng, model = self.engine(HYBRID_MODEL, connector=None, pool_policy="lifo")
        reqs = [{"id": "h1", "prompt": prompt(3, 150), "max_tokens": 20},
                {"id": "h2", "prompt": prompt(4, 90), "max_tokens": 4, "arrive": 2}]
        res = eng.run(reqs, preempt=[{"req": "h1", "computed": 128}])
        self.assert_outputs(res, model, reqs)
        self.assertEqual(res["info"]["h1"]["preemptions"], 1)


class Config(unittest.TestCase):
    def test_extra_config_checked_and_layout_named(self):
        """Bad extra-config keys and values are refused at start; the layout
        the connector asks vLLM for is part of the namespace (NHD and HND
        pages have one size: the server could not tell them apart)."""
        from types import SimpleNamespace as NSp
        from kvside.vllm.config import ConnectorConfig, namespace_of
        from kvside.vllm import KvsideConnector
        for bad, needle in (({"chunk_tokens": "256"}, "chunk_tokens"), ({"store": "later"}, "store"),
                            ({"kv_layout": "XYZ"}, "kv_layout"), ({"brokerdir": "/x"}, "unknown"),
                            ({"load": 1}, "load")):
            with self.assertRaises(ValueError) as e:
                ConnectorConfig.from_extra(bad)
            self.assertIn(needle, str(e.exception))
        vc = NSp(kv_transfer_config=NSp(kv_connector_extra_config={}))
        self.assertEqual(KvsideConnector.get_required_kvcache_layout(vc), "NHD")
        vc.kv_transfer_config.kv_connector_extra_config = {"kv_layout": "HND"}
        self.assertEqual(KvsideConnector.get_required_kvcache_layout(vc), "HND")
        cfg = ConnectorConfig.from_extra({})
        a = namespace_of(cfg, "m", "bf16", 2, [16], "sha256", "NHD")
        b = namespace_of(cfg, "m", "bf16", 2, [16], "sha256", "HND")
        self.assertNotEqual(a, b)


class Api(unittest.TestCase):
    """The connector's methods against vLLM's base classes at the commit named
    in vllm_api.txt (and the stand-in's base classes against the same list)."""

    @staticmethod
    def parse():
        out = []
        with open(API_FILE) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = re.match(r"((?:@\w+ )*)(\w+)\.(\w+)\((.*)\)$", line)
                assert m, line
                decos = set(m.group(1).replace("@", "").split())
                params = [p.strip() for p in m.group(4).split(",") if p.strip()]
                out.append((decos, m.group(2), m.group(3), params))
        return out

    @staticmethod
    def params(fn):
        return [("**" if p.kind == p.VAR_KEYWORD else "*" if p.kind == p.VAR_POSITIONAL else "") + p.name
                for p in inspect.signature(fn).parameters.values()]

    @staticmethod
    def static(cls, name):
        for k in cls.__mro__:
            if name in k.__dict__:
                return k, k.__dict__[name]
        return None, None

    def describe(self, cls, decos, name):
        owner, raw = self.static(cls, name)
        if raw is None:
            return None, None, None
        if isinstance(raw, property):
            return owner, "property", self.params(raw.fget)
        if isinstance(raw, classmethod):
            return owner, "classmethod", ["cls"] + self.params(raw.__func__)[1:]
        return owner, "method", self.params(raw)

    def test_stub_base_matches_the_list(self):
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        for decos, cname, name, want in self.parse():
            cls = getattr(base, cname)
            owner, kind, got = self.describe(cls, decos, name)
            self.assertIsNotNone(kind, "stand-in %s lacks %s" % (cname, name))
            self.assertEqual(kind, "property" if "property" in decos else
                             "classmethod" if "classmethod" in decos else "method", name)
            self.assertEqual(got, want, "stand-in %s.%s parameters" % (cname, name))
            abstract = name in getattr(cls, "__abstractmethods__", ())
            self.assertEqual(abstract, "abstractmethod" in decos, "%s.%s abstract" % (cname, name))

    def test_connector_keeps_vllm_api(self):
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from kvside.vllm import KvsideConnector
        self.assertTrue(issubclass(KvsideConnector, base.KVConnectorBase_V1))
        self.assertTrue(base.supports_hma(KvsideConnector))
        self.assertEqual(sorted(KvsideConnector.__abstractmethods__), [],
                         "abstract methods the connector does not define")
        vllm_classes = (base.KVConnectorBase_V1, base.SupportsHMA)
        problems = []
        for decos, cname, name, want in self.parse():
            owner, kind, got = self.describe(KvsideConnector, decos, name)
            if owner is None:
                problems.append("%s missing" % name)
                continue
            if "abstractmethod" in decos and owner in vllm_classes:
                problems.append("%s (abstract in vLLM) is not defined by the connector" % name)
            if owner in vllm_classes:
                continue  # inherited unchanged
            want_kind = ("property" if "property" in decos else "classmethod" if "classmethod" in decos
                         else "method")
            if kind != want_kind:
                problems.append("%s.%s is a %s, vLLM's is a %s" % (owner.__name__, name, kind, want_kind))
            elif got != want:
                problems.append("%s.%s%s: vLLM's parameters are (%s) (vllm_api.txt)"
                                % (owner.__name__, name, tuple(got), ", ".join(want)))
        self.assertEqual(problems, [], "\n".join(problems))


class Connector(Base):
    def test_kv_events_name_chunks_by_vllm_hashes(self):
        """A server publishing KV events: the chunks a request stores are named
        by vLLM's own block hash of each chunk's last block (what vLLM's events
        and routers use), not by kvside's chunk keys."""
        try:
            import msgpack
            import zmq
        except ImportError as e:  # Debian's python3-zmq/-msgpack: in CI; not on every GPU image
            self.skipTest("needs pyzmq and msgpack: %s" % e)
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request
        srv = Server()
        pub = "ipc://" + os.path.join(srv.tmp, "events")
        srv.extra += ["--kv-events", pub]
        self.servers.append(srv)
        srv.start()
        ctx = zmq.Context()
        self.closers.append(lambda: ctx.destroy(0))
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        time.sleep(0.3)
        eng, model = self.engine(FULL_MODEL, extra=extra_config(srv))
        reqs = [{"id": "a", "prompt": prompt(30, 200), "max_tokens": 2}]
        res = eng.run(reqs)
        self.assert_outputs(res, model, reqs)
        names = set()
        deadline = time.time() + 5
        while time.time() < deadline and len(names) < 3:
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                for ev in msgpack.unpackb(payload, raw=False)[1]:
                    if ev["type"] == "BlockStored" and ev["medium"] == "CPU":
                        names |= {bytes(h) for h in ev["block_hashes"]}
        bs = FULL_MODEL["groups"][0].block_size
        hasher = get_request_block_hasher(bs)
        from vllm.sampling_params import SamplingParams
        hashes = Request("x", reqs[0]["prompt"], SamplingParams(max_tokens=2), block_hasher=hasher).block_hashes
        per_chunk = 64 // bs
        want = {bytes(hashes[(c + 1) * per_chunk - 1]) for c in range(200 // 64)}
        self.assertEqual(names, want, "BlockStored names are not vLLM's chunk-end block hashes")

    def test_tp2_shared_prefix_stored_then_loaded(self):
        """2 TP ranks, full attention: a finished request's chunks are stored;
        later requests sharing its prefix (and a second engine) load them
        byte-exact and generate the same tokens as without a cache."""
        srv = self.server()
        cfg = extra_config(srv)
        eng, model = self.engine(FULL_MODEL, extra=cfg)
        shared = prompt(10, 200)
        first = [{"id": "a", "prompt": shared + prompt(11, 30), "max_tokens": 6},
                 {"id": "a2", "prompt": prompt(12, 100), "max_tokens": 3, "arrive": 1}]
        res = eng.run(first)
        self.assert_outputs(res, model, first)
        self.assertEqual(self.ext(res, "a"), 0)
        # each rank's store is one message: the part carries its complete
        st = res["stats"]
        self.assertGreater(st.get("stores", 0), 0, st)
        self.assertEqual(st.get("store_messages"), st["stores"], st)
        later = [{"id": "b", "prompt": shared + prompt(13, 40), "max_tokens": 6},
                 {"id": "c", "prompt": shared[:150] + prompt(14, 20), "max_tokens": 4, "arrive": 1},
                 {"id": "d", "prompt": prompt(15, 120), "max_tokens": 3}]
        res = eng.run(later)
        self.assert_outputs(res, model, later)
        self.assertEqual(self.ext(res, "b"), 192, res["info"]["b"])   # 3 whole chunks of 64
        self.assertEqual(self.ext(res, "c"), 128, res["info"]["c"])
        self.assertEqual(self.ext(res, "d"), 0)
        self.assertEqual([r for r in res["log"] if r[1] == "load-error"], [])
        # chunks completed by generated tokens are stored too; two requests
        # computing the same new prefix at once both store it
        dec = [{"id": "g", "prompt": prompt(17, 120), "max_tokens": 20},
               {"id": "p1", "prompt": prompt(18, 150), "max_tokens": 2},
               {"id": "p2", "prompt": prompt(18, 150)[:140] + prompt(19, 30), "max_tokens": 2}]
        res = eng.run(dec)
        self.assert_outputs(res, model, dec)
        grown = dec[0]["prompt"] + res["tokens"]["g"][:10]
        hits = [{"id": "h", "prompt": grown + prompt(20, 5), "max_tokens": 3},
                {"id": "h2", "prompt": prompt(18, 150) + prompt(21, 3), "max_tokens": 3}]
        res = eng.run(hits)
        self.assert_outputs(res, model, hits)
        self.assertEqual(self.ext(res, "h"), 128, "the chunk completed during decode was not stored: %s"
                         % res["info"]["h"])
        self.assertEqual(self.ext(res, "h2"), 128, res["info"]["h2"])
        # a second engine (its own kvside engine name) finds the same chunks
        eng2, _ = self.engine(FULL_MODEL, extra=cfg, engine_id="engine-1")
        again = [{"id": "e", "prompt": shared + prompt(16, 10), "max_tokens": 5}]
        res = eng2.run(again)
        self.assert_outputs(res, model, again)
        self.assertEqual(self.ext(res, "e"), 192, res["info"]["e"])

    def test_hybrid_full_window_mamba(self):
        """Full attention (block 32) + sliding window 40 (block 16) + Mamba
        "align" (block 32), chunk_tokens 32 = the Mamba block size: chunks
        stored as prefill passes them; later requests restore the window and
        the exact Mamba state at a chunk boundary and generate the same
        tokens."""
        srv = self.server()
        eng, model = self.engine(HYBRID_MODEL, extra=extra_config(srv, chunk_tokens=32))
        shared = prompt(20, 200)
        first = [{"id": "a", "prompt": shared, "max_tokens": 5}]
        res = eng.run(first)
        self.assert_outputs(res, model, first)
        # the budget of 64 tokens ends prefill steps at 64, 128, 192: states exist there
        later = [{"id": "b", "prompt": shared[:192] + prompt(21, 20), "max_tokens": 8},
                 {"id": "c", "prompt": shared[:140] + prompt(22, 30), "max_tokens": 6, "arrive": 1},
                 {"id": "d", "prompt": prompt(23, 80), "max_tokens": 3, "arrive": 1},
                 {"id": "e", "prompt": shared[:100] + prompt(24, 10), "max_tokens": 3, "arrive": 2}]
        res = eng.run(later)
        self.assert_outputs(res, model, later)
        self.assertEqual(self.ext(res, "b"), 192, res["info"]["b"])
        self.assertEqual(self.ext(res, "c"), 128, res["info"]["c"])
        # no state was materialised at 96 (steps ended at 64 and 128): the hit stops at 64
        self.assertEqual(self.ext(res, "e"), 64, res["info"]["e"])
        self.assertGreaterEqual(res["info"]["b"]["load_checks"], 1)
        # preempted mid-prefill: resumes from its own stored chunk (state at 128)
        more = [{"id": "f", "prompt": prompt(25, 230), "max_tokens": 4},
                {"id": "g", "prompt": prompt(26, 90), "max_tokens": 20, "arrive": 1}]
        res = eng.run(more, preempt=[{"req": "f", "computed": 128}])
        self.assert_outputs(res, model, more)
        self.assertEqual(res["info"]["f"]["preemptions"], 1)
        self.assertEqual(self.ext(res, "f"), 128, res["info"]["f"])

    def test_hybrid_under_block_pressure(self):
        """Hybrid model, a pool too small for all requests (preemptions by
        the scheduler itself and forced ones, freed blocks reused first): requests sharing
        prefixes store and load while sliding-window blocks and Mamba states
        are freed and reallocated under them; then a full-attention +
        sliding-window model (no Mamba: synchronous loads) the same way."""
        srv = self.server()
        eng, model = self.engine(HYBRID_MODEL, extra=extra_config(srv, chunk_tokens=32), pool_policy="lifo",
                                 num_blocks=40, max_num_batched_tokens=96)
        base = prompt(80, 260)
        reqs = [{"id": "r%d" % i, "prompt": base[:100 + 30 * i] + prompt(81 + i, 20), "max_tokens": 40 + 8 * i,
                 "arrive": 2 * i} for i in range(6)]
        # (the scheduler's own preemptions depend on when loads end: two are forced)
        res = eng.run(reqs, timeout=90, preempt=[{"req": "r1", "computed": 150}, {"req": "r4", "computed": 200}])
        self.assert_outputs(res, model, reqs)
        pre = sum(res["info"][r["id"]]["preemptions"] for r in reqs)
        self.assertGreaterEqual(pre, 2, res["log"])
        hit = sum(self.ext(res, r["id"]) for r in reqs)
        self.assertGreater(hit, 0, res["info"])
        again = [{"id": "s%d" % i, "prompt": base[:90 + 40 * i] + prompt(90 + i, 10), "max_tokens": 6,
                  "arrive": i} for i in range(5)]
        res = eng.run(again, timeout=90)
        self.assert_outputs(res, model, again)
        self.assertGreater(sum(self.ext(res, r["id"]) for r in again), 0, res["info"])
        if os.environ.get("KVT_VERBOSE"):
            print("preemptions in the first phase: %d" % pre, file=sys.stderr)
        swa = dict(groups=[E.GroupDef("full", 16, 2, num_kv_heads=2, head_size=8),
                           E.GroupDef("swa", 16, 2, num_kv_heads=2, head_size=8, sliding_window=24)],
                   num_blocks=48, max_num_batched_tokens=80)
        eng, model = self.engine(swa, extra=extra_config(srv, chunk_tokens=32), engine_id="engine-swa",
                                 pool_policy="lifo")
        reqs = [{"id": "w%d" % i, "prompt": base[:70 + 50 * i] + prompt(95 + i, 15), "max_tokens": 10,
                 "arrive": 3 * i} for i in range(4)]
        res = eng.run(reqs, timeout=90)
        self.assert_outputs(res, model, reqs)
        self.assertGreater(sum(self.ext(res, r["id"]) for r in reqs), 0, res["info"])

    def test_abort_while_loading_and_saving(self):
        """Requests aborted by the client (Scheduler.finish_requests): one
        while its asynchronous load is in flight (vLLM holds its blocks until
        finished_recving and frees them then: the connector must not also
        delay the free), one mid-prefill with stores in flight. The engine
        drains, and the stored prefix still loads byte-exact afterwards."""
        srv = self.server()
        eng, model = self.engine(HYBRID_MODEL, extra=extra_config(srv, chunk_tokens=32))
        shared = prompt(100, 200)
        first = [{"id": "a", "prompt": shared, "max_tokens": 3}]
        self.assert_outputs(eng.run(first), model, first)
        reqs = [{"id": "b", "prompt": shared[:192] + prompt(101, 20), "max_tokens": 5},
                {"id": "r", "prompt": prompt(102, 250), "max_tokens": 5}]
        res = eng.run(reqs, hooks={"abort-b": lambda info: {"abort": ["b"]},
                                   "abort-r": lambda info: {"abort": ["r"]}},
                      triggers=[{"id": "abort-b", "on": "matched", "req": "b"},
                                {"id": "abort-r", "on": "step", "step": 3}])
        self.assertEqual(res["checks"], [])
        self.assertEqual(res["tokens"]["b"], [])
        self.assertEqual(res["tokens"]["r"], model.generate(reqs[1]["prompt"], 5)[:len(res["tokens"]["r"])])
        self.assertEqual([e[2] for e in res["log"] if e[1] == "abort"], ["b", "r"], res["log"])
        later = [{"id": "c", "prompt": shared[:192] + prompt(103, 10), "max_tokens": 4}]
        res = eng.run(later)
        self.assert_outputs(res, model, later)
        self.assertEqual(self.ext(res, "c"), 192, res["info"]["c"])

    def test_preemption_while_saving(self):
        """A request is preempted right after a step that planned a store of
        its chunks; its blocks go straight to the next allocation (LIFO pool)
        and are overwritten in that step. The stored chunks must still be the
        preempted request's bytes: a later request loads them byte-exact. Run
        with the V1 model runner's call order and with V2's (the default for
        dense models: handle_preemptions inside pre_forward, a resumed request
        sent as a new one)."""
        srv = self.server()
        for runner in ("v1", "v2"):
            eng, model = self.engine(FULL_MODEL, extra=extra_config(srv, namespace_salt=runner),
                                     engine_id="engine-" + runner, pool_policy="lifo", num_blocks=64,
                                     max_num_batched_tokens=128, runner=runner)
            shared = prompt(30, 320)
            reqs = [{"id": "a", "prompt": shared, "max_tokens": 4},
                    {"id": "x", "prompt": prompt(31, 300), "max_tokens": 4, "arrive": 1}]
            res = eng.run(reqs, preempt=[{"req": "a", "computed": 192}])
            self.assert_outputs(res, model, reqs)
            self.assertEqual(res["info"]["a"]["preemptions"], 1, res["log"])
            self.assertEqual(self.ext(res, "a"), 256, "%s: the preempted request did not resume from its "
                             "stored chunks: %s" % (runner, res["info"]["a"]))
            later = [{"id": "b", "prompt": shared[:256] + prompt(32, 9), "max_tokens": 4}]
            res = eng.run(later)
            self.assert_outputs(res, model, later)
            self.assertEqual(self.ext(res, "b"), 256, res["info"]["b"])

    def test_server_killed_and_restarted(self):
        """SIGKILL of the server between a hit and its load: the load is
        reported as failed, the request recomputes, stores in flight end, the
        engine keeps stepping; after a restart (L2 kept the chunks) a request
        loads again. Same tokens throughout, nothing hangs."""
        srv = self.server(l2=True)
        cfg = extra_config(srv, timeout_ms=1500, load_timeout_ms=1500, save_wait_ms=2000, open_timeout_ms=300)
        eng, model = self.engine(FULL_MODEL, extra=cfg)
        shared = prompt(40, 256)
        first = [{"id": "a", "prompt": shared, "max_tokens": 3}]
        self.assert_outputs(eng.run(first), model, first)
        time.sleep(0.3)   # let L2 write-behind take the chunks

        def kill(info):
            srv.kill()

        def restart(info):
            srv.start()
            time.sleep(1.0)   # the sessions notice the restart (heartbeats) and re-open

        reqs = [{"id": "b", "prompt": shared[:192] + prompt(41, 30), "max_tokens": 4},
                {"id": "y", "prompt": prompt(42, 250), "max_tokens": 12},
                {"id": "c", "prompt": shared + prompt(43, 5), "max_tokens": 4, "arrive": 25}]
        res = eng.run(reqs, hooks={"kill": kill, "restart": restart},
                      triggers=[{"id": "kill", "on": "matched", "req": "b"},
                                {"id": "restart", "on": "step", "step": 12}], timeout=90)
        self.assert_outputs(res, model, reqs)
        self.assertGreater(self.ext(res, "b"), 0, res["info"]["b"])
        self.assertNotEqual(res["info"]["b"]["recomputes"], [],
                            "the load after the kill was not reported as failed: %s" % res["log"])
        self.assertGreater(self.ext(res, "c"), 0, "no hit after the restart: %s" % res["info"]["c"])

    def test_store_when_finished(self):
        """store "finished": nothing is stored while the request runs; its
        chunks are stored when it ends (blocks held until then) and a later
        request loads them."""
        srv = self.server()
        eng, model = self.engine(FULL_MODEL, extra=extra_config(srv, store="finished"))
        shared = prompt(60, 200)
        first = [{"id": "a", "prompt": shared, "max_tokens": 3}]
        res = eng.run(first)
        self.assert_outputs(res, model, first)
        self.assertTrue(res["info"]["a"]["delayed_free"], res["info"]["a"])
        later = [{"id": "b", "prompt": shared + prompt(61, 7), "max_tokens": 3}]
        res = eng.run(later)
        self.assert_outputs(res, model, later)
        self.assertEqual(self.ext(res, "b"), 192, res["info"]["b"])

    def test_evicted_between_lookup_and_load(self):
        """admin clear right after the lookup answered a hit (pins off): the
        load misses, its blocks are reported, the request recomputes and
        generates the same tokens."""
        srv = self.server()
        eng, model = self.engine(FULL_MODEL, extra=extra_config(srv, pin_ms=0))
        shared = prompt(50, 200)
        first = [{"id": "a", "prompt": shared, "max_tokens": 3}]
        self.assert_outputs(eng.run(first), model, first)
        admin = kvside.Client("admin", "admin", role="scheduler", broker_dir=srv.run, timeout_ms=3000)
        self.closers.append(admin.close)
        cleared = []

        def clear(info):
            deadline = time.time() + 3
            while True:
                try:
                    cleared.append(admin.admin("clear"))
                    return
                except kvside.KvsideError as e:
                    if e.code_name != "E_BUSY" or time.time() > deadline:
                        raise
                    time.sleep(0.02)

        reqs = [{"id": "b", "prompt": shared + prompt(51, 20), "max_tokens": 5}]
        res = eng.run(reqs, hooks={"clear": clear}, triggers=[{"id": "clear", "on": "matched", "req": "b"}])
        self.assertEqual(len(cleared), 1)
        self.assertGreater(cleared[0]["cleared_l1"], 0, cleared)
        self.assert_outputs(res, model, reqs)
        self.assertEqual(self.ext(res, "b"), 192, res["info"]["b"])
        self.assertNotEqual(res["info"]["b"]["recomputes"], [], "the missed load was not reported: %s"
                            % res["log"])
        # the same in a hybrid model (the Mamba state is loaded asynchronously)
        eng, model = self.engine(HYBRID_MODEL, extra=extra_config(srv, chunk_tokens=32, pin_ms=0),
                                 engine_id="engine-h")
        first = [{"id": "ha", "prompt": shared, "max_tokens": 3}]
        self.assert_outputs(eng.run(first), model, first)
        reqs = [{"id": "hb", "prompt": shared[:130] + prompt(52, 20), "max_tokens": 5}]
        res = eng.run(reqs, hooks={"clear": clear}, triggers=[{"id": "clear", "on": "matched", "req": "hb"}])
        self.assertEqual(len(cleared), 2)
        self.assertGreater(cleared[1]["cleared_l1"], 0, cleared)
        self.assert_outputs(res, model, reqs)
        self.assertEqual(self.ext(res, "hb"), 128, res["info"]["hb"])
        self.assertNotEqual(res["info"]["hb"]["recomputes"], [], "the missed load was not reported: %s"
                            % res["log"])

    def test_recomputed_prefix_is_stored_again(self):
        """A request whose (synchronous) load failed recomputes its prefix:
        the recomputed chunks are stored again, so the next request with that
        prefix hits; and the blocks the failed load left unwritten must never
        be stored under the prefix's keys (the next request would load them
        without any error and generate other tokens)."""
        srv = self.server()
        eng, model = self.engine(FULL_MODEL, extra=extra_config(srv, pin_ms=0))
        shared = prompt(70, 200)
        first = [{"id": "a", "prompt": shared, "max_tokens": 3}]
        self.assert_outputs(eng.run(first), model, first)
        admin = kvside.Client("admin", "admin", role="scheduler", broker_dir=srv.run, timeout_ms=3000)
        self.closers.append(admin.close)
        reqs = [{"id": "b", "prompt": shared + prompt(71, 20), "max_tokens": 3}]
        res = eng.run(reqs, hooks={"clear": lambda info: admin.admin("clear")},
                      triggers=[{"id": "clear", "on": "matched", "req": "b"}])
        self.assert_outputs(res, model, reqs)
        self.assertNotEqual(res["info"]["b"]["recomputes"], [])
        reqs = [{"id": "c", "prompt": shared + prompt(72, 20), "max_tokens": 3}]
        res = eng.run(reqs)
        self.assert_outputs(res, model, reqs)
        self.assertEqual(self.ext(res, "c"), 192, "b recomputed the prefix after its failed load but did not "
                         "store it again: %s" % res["info"]["c"])


if __name__ == "__main__":
    if not SERVER:
        print("KVS_SERVER not set", file=sys.stderr)
        sys.exit(2)
    unittest.main(verbosity=2)
