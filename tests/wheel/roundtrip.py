"""Runs in the venv the wheel was installed into (tests/wheel/test_wheel.sh),
with KVSIDE_LIB and PYTHONPATH unset and python3 -I: kvside and its library
must come from the installed wheel. A round trip against a real
kvside-server ($KVS_SERVER): register host memory, store, complete, lookup,
retrieve into other blocks, byte-exact with nothing else touched; the
installed version is meson.build's ($KVT_VERSION); kvside.layout and
kvside.torch_alloc import without torch (which this venv lacks)."""

import importlib.metadata
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import kvside

SERVER = os.environ["KVS_SERVER"]
NS = "wheel-model"
TPB, BPC = 16, 4              # tokens per block, blocks per chunk
LAYERS, BLOCKS, BLOCK_BYTES, STRIDE = 2, 48, 4096, 4096 + 128
REGION = LAYERS * BLOCKS * STRIDE


def inside(path, top):
    path, top = os.path.realpath(path), os.path.realpath(top)
    return os.path.commonpath([path, top]) == top


class WheelTest(unittest.TestCase):
    def test_installed_package(self):
        self.assertNotIn("KVSIDE_LIB", os.environ)
        self.assertTrue(inside(kvside.__file__, sys.prefix), kvside.__file__)
        lib = kvside.library()
        self.assertEqual(os.path.realpath(lib), os.path.realpath(
            os.path.join(os.path.dirname(kvside.__file__), "_lib", "libkvside.so.0")))
        self.assertEqual(importlib.metadata.version("kvside"), os.environ["KVT_VERSION"])
        files = {str(f) for f in importlib.metadata.files("kvside")}
        for f in ("kvside/vllm/connector.py", "kvside/vllm/worker.py", "kvside/sglang/storage.py",
                  "kvside/_lib/libkvside.so.0"):
            self.assertIn(f, files)
        # the engine modules are installed (importing them needs the engine itself)
        for mod in ("kvside.vllm", "kvside.sglang", "kvside.layout", "kvside.torch_alloc"):
            spec = importlib.util.find_spec(mod)
            self.assertIsNotNone(spec, mod)
            self.assertTrue(inside(spec.origin, sys.prefix), spec.origin)

    def test_torch_alloc_and_layout_without_torch(self):
        self.assertIsNone(importlib.util.find_spec("torch"), "this venv should not see torch")
        from kvside import layout, torch_alloc
        self.assertTrue(callable(layout.block_views))
        with self.assertRaises(RuntimeError) as e:
            torch_alloc.allocator()
        self.assertIn("PyTorch", str(e.exception))

    def test_roundtrip(self):
        tmp = tempfile.mkdtemp(prefix="kvt-wheel-srv-")
        run = os.path.join(tmp, "run")
        log = open(os.path.join(tmp, "server.log"), "ab")
        proc = subprocess.Popen(
            [SERVER, "--broker-dir", run, "--ttl-ms", "3000", "--heartbeat-ms", "100",
             "--l1-size", "64M", "--metrics-listen", "off", "--log-level", "warn", "--no-prefault"],
            stdout=log, stderr=subprocess.STDOUT)
        closers = []
        try:
            deadline = time.time() + 10
            while True:
                if os.path.exists(os.path.join(run, "kvside.zmq")):
                    try:
                        kvside.Client("probe", NS, role="scheduler", broker_dir=run,
                                      timeout_ms=1000).close()
                        break
                    except kvside.KvsideError:
                        pass
                self.assertIsNone(proc.poll(), "server exited")
                self.assertLess(time.time(), deadline, "server did not start")
                time.sleep(0.05)

            sched = kvside.Client("wheel-eng", NS, role="scheduler", world=1, broker_dir=run,
                                  timeout_ms=5000)
            closers.append(sched.close)
            mem = kvside.HostMemory(REGION, name="kvt-wheel")
            closers.append(mem.close)
            mem.view[:] = os.urandom(REGION)
            orig = bytes(mem.view)
            worker = kvside.Client("wheel-eng", NS, role="worker", rank=0, world=1, broker_dir=run,
                                   timeout_ms=5000)
            closers.append(worker.close)
            handle = worker.register_memory(
                [mem], groups=[kvside.Group(0, "attention", TPB, BPC)],
                layers=[kvside.Layer(0, 0, l * BLOCKS * STRIDE, BLOCKS, STRIDE, BLOCK_BYTES)
                        for l in range(LAYERS)])
            n = 3
            keys = kvside.chunk_keys(NS, [7 + 13 * i for i in range(n * TPB * BPC)], TPB * BPC)
            self.assertEqual(len(keys), n)
            self.assertEqual(sched.lookup(keys).hits, 0)

            self.assertEqual(worker.store(1, keys, [list(range(n * BPC))]), "open")
            worker.complete(1)
            self.assertEqual(sched.job_wait(1, 5000), "committed")
            lk = sched.lookup(keys)
            self.assertEqual(lk.hits, n)
            self.assertEqual(lk.tiers, ["l1"] * n)

            dst = 24
            self.assertEqual(worker.retrieve(2, keys, [list(range(dst, dst + n * BPC))]), "open")
            worker.complete(2)
            self.assertEqual(sched.job_wait(2, 5000), "committed")

            now = bytes(mem.view)
            want = bytearray(orig)
            for l in range(LAYERS):
                for b in range(n * BPC):
                    src = l * BLOCKS * STRIDE + b * STRIDE
                    to = l * BLOCKS * STRIDE + (dst + b) * STRIDE
                    want[to:to + BLOCK_BYTES] = orig[src:src + BLOCK_BYTES]
            self.assertTrue(now == bytes(want), "retrieved bytes differ, or bytes outside the "
                            "destination blocks changed")
            worker.unregister(handle)
            self.assertEqual(sched.stats()["registrations"], 0)
        finally:
            for c in reversed(closers):
                c()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
            else:
                rc = proc.returncode
            log.close()
            if rc != 0:
                with open(os.path.join(tmp, "server.log"), "rb") as f:
                    sys.stderr.write(f.read().decode(errors="replace")[-4000:])
            shutil.rmtree(tmp, ignore_errors=True)
        self.assertEqual(rc, 0, "server exit status")


if __name__ == "__main__":
    unittest.main(verbosity=2)
