#!/usr/bin/python3
"""Tests of the Python binding (worker/python/kvside) on CPU, against the real
kvside-server: Debian's python3, standard library only.

Environment: KVSIDE_LIB (the built libkvside.so), KVS_SERVER (the server
binary), PYTHONPATH holding worker/python; KVT_SERVER_WRAPPER (e.g. valgrind)
runs the server under a tool, whose non-zero exit fails the test.

Covered: open/close and the context manager; two ranks (threads, one client
each) registering memfd regions, store -> complete -> job_wait -> lookup ->
retrieve into other blocks, byte-exact with everything else untouched;
errors raised with the right code name; chunk keys equal to the C library's
golden vectors (tests/unit/test_chunkkey.c); events (job_done, reconnected
after a server restart); job_status, stats, admin; the CUDA entry points
failing cleanly without a GPU; torch_alloc importable without torch.
"""

import os
import sys
import threading
import time
import unittest

import kvside

SERVER = os.environ.get("KVS_SERVER")
NS = "py-model"
TOKENS_PER_BLOCK = 16
BPC = 4                      # blocks per chunk
CHUNK = TOKENS_PER_BLOCK * BPC
LAYERS = 3
BLOCKS = 64
BLOCK_BYTES = 2048
STRIDE = 2048 + 64           # padded: only BLOCK_BYTES of each block are copied
REGION = LAYERS * BLOCKS * STRIDE


# the server every Python test starts (tests/vllm, tests/sglang import it from here too)
from kvt_server import Server  # noqa: E402,F401


def tokens(prompt, n_chunks):
    return [1000 + i * 7 + prompt * 100003 for i in range(n_chunks * CHUNK)]


def block_ids(first_block, n_keys):
    return [[first_block + i for i in range(n_keys * BPC)]]


def block_at(mem, layer, block):
    off = layer * BLOCKS * STRIDE + block * STRIDE
    return bytes(mem.view[off:off + BLOCK_BYTES])


class Rank:
    """One TP rank: a client, a memfd region of random bytes, a registration."""

    def __init__(self, srv, rank, world, engine="py-eng"):
        self.mem = kvside.HostMemory(REGION, name="kvt-rank%d" % rank)
        self.mem.view[:] = os.urandom(REGION)
        self.orig = bytes(self.mem.view)
        self.client = kvside.Client(engine, NS, role="worker", rank=rank, world=world,
                                    broker_dir=srv.run, timeout_ms=5000)
        self.handle = self.client.register_memory(
            [self.mem], groups=[kvside.Group(0, "attention", TOKENS_PER_BLOCK, BPC)],
            layers=[kvside.Layer(0, 0, l * BLOCKS * STRIDE, BLOCKS, STRIDE, BLOCK_BYTES)
                    for l in range(LAYERS)])

    def close(self):
        self.client.close()
        self.mem.close()


class BindingTest(unittest.TestCase):
    def setUp(self):
        self.srv = Server()
        self.srv.start()
        self.closers = []

    def tearDown(self):
        for c in reversed(self.closers):
            c()
        rc = self.srv.stop()
        self.srv.cleanup()
        self.assertEqual(rc, 0, "server exit status (99: valgrind found errors or leaks)")

    def client(self, **kw):
        args = dict(engine="py-eng", namespace=NS, role="scheduler", world=2,
                    broker_dir=self.srv.run, timeout_ms=5000)
        args.update(kw)
        c = kvside.Client(**args)
        self.closers.append(c.close)
        return c

    def test_open_close_and_context(self):
        with kvside.Client("py-eng", NS, role="scheduler", broker_dir=self.srv.run) as c:
            self.assertNotEqual(c.session, 0)
            self.assertEqual(c.reconnects, 0)
            st = c.stats()
            self.assertGreaterEqual(st["sessions"], 1)
            self.assertIn("errors.E_BADMSG", st)
        with self.assertRaises(kvside.KvsideError) as e:
            c.stats()
        self.assertEqual(e.exception.code_name, "EBADF")
        c.close()  # idempotent

    def test_two_ranks_roundtrip(self):
        sched = self.client()
        done = []
        ev_sched = self.client(on_event=done.append)
        ranks = [Rank(self.srv, r, 2) for r in range(2)]
        for r in ranks:
            self.closers.append(r.close)
        n = 4
        keys = kvside.chunk_keys(NS, tokens(0, n), CHUNK)
        self.assertEqual(len(keys), n)
        self.assertEqual(sched.lookup(keys).hits, 0)
        errors = []

        def part(r, job, op):
            try:
                if op == "store":
                    self.assertEqual(r.client.store(job, keys, block_ids(0, n)), "open")
                else:
                    self.assertEqual(r.client.retrieve(job, keys, block_ids(32, n)), "open")
                r.client.complete(job)
            except Exception as e:  # reported below, on the test thread
                errors.append(e)

        for job, op in ((1, "store"), (2, "retrieve")):
            ts = [threading.Thread(target=part, args=(r, job, op)) for r in ranks]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(errors, [])
            self.assertEqual(sched.job_wait(job, 5000), "committed")
            if op == "store":
                lk = sched.lookup(keys)
                self.assertEqual(lk.hits, n)
                self.assertEqual(lk.tiers, ["l1"] * n)
                self.assertEqual(sched.lookup(keys[:2]).hits, 2)
        # byte-exact: blocks 32.. now hold blocks 0.. of the same rank, nothing else moved
        for r in ranks:
            for l in range(LAYERS):
                for b in range(n * BPC):
                    self.assertEqual(block_at(r.mem, l, 32 + b), block_at(r.mem, l, b))
            now = bytes(r.mem.view)
            changed = [i for i in range(0, REGION, 4096) if now[i:i + 4096] != r.orig[i:i + 4096]]
            dst = set()
            for l in range(LAYERS):
                for b in range(n * BPC):
                    off = l * BLOCKS * STRIDE + (32 + b) * STRIDE
                    dst.update(range(off // 4096 * 4096, off + BLOCK_BYTES, 4096))
            self.assertTrue(set(changed) <= dst, "bytes changed outside the destination blocks")
            # inside those pages, only the destination bytes themselves differ
            for l in range(LAYERS):
                for b in range(n * BPC):
                    off = l * BLOCKS * STRIDE + (32 + b) * STRIDE + BLOCK_BYTES
                    self.assertEqual(now[off:off + STRIDE - BLOCK_BYTES],
                                     r.orig[off:off + STRIDE - BLOCK_BYTES])
        # events: the scheduler heard job_done for both jobs
        deadline = time.time() + 5
        while len([e for e in done if e.type == "job_done"]) < 2 and time.time() < deadline:
            time.sleep(0.02)
        jd = {e.job: e for e in done if e.type == "job_done"}
        self.assertEqual(jd[1].state, "committed")
        self.assertEqual(jd[2].state, "committed")
        infos = sched.job_status([1, 2, 77])
        self.assertEqual([(i.job, i.state) for i in infos],
                         [(1, "committed"), (2, "committed"), (77, "unknown")])
        st = sched.stats()
        self.assertEqual(st["retained_blocks"], 0)
        self.assertEqual(st["jobs_committed"], 2)
        self.assertEqual(st["registrations"], 2)
        for r in ranks:
            r.client.unregister(r.handle)
        self.assertEqual(sched.stats()["registrations"], 0)

    def test_async_parts_and_buffer_block_lists(self):
        """store_async + complete_async back to back on two ranks, then
        retrieve_async; block ids given as array('q'), numpy and torch buffers
        (the ones importable here), a list, and refused when malformed."""
        import array
        sched = self.client()
        ranks = [Rank(self.srv, r, 2) for r in range(2)]
        for r in ranks:
            self.closers.append(r.close)
        n = 2
        keys = kvside.chunk_keys(NS, tokens(3, n), CHUNK)
        kinds = [lambda ids: array.array("q", ids), list]
        try:
            import numpy
            kinds.append(lambda ids: numpy.array(ids, dtype=numpy.int64))
        except ImportError:
            pass
        try:
            import torch
            kinds.append(lambda ids: torch.tensor(ids, dtype=torch.int64))
        except ImportError:
            pass
        called = []
        job = 40
        for kind in kinds:
            job += 1
            ps = []
            for r in ranks:
                ps.append(r.client.store_async(job, keys, [kind(block_ids(0, n)[0])],
                                               callback=lambda p: called.append(p.job)))
                ps.append(r.client.complete_async(job))
            got = [(p.op, p.result(5)) for p in ps]
            self.assertEqual([g[1] for g in got[:3:2]], ["open", "open"], got)  # the parts
            # either rank's messages may reach the server first
            self.assertTrue(all(g[1] in ("open", "committed") for g in got[1::2]), got)
            self.assertEqual(sched.job_wait(job, 5000), "committed")
            job += 1
            dst = 32 + (job % 3) * 2 * BPC
            ps = [r.client.retrieve_async(job, keys, [kind(block_ids(dst, n)[0])]) for r in ranks]
            self.assertEqual([p.result(5) for p in ps], ["open", "open"])
            for r in ranks:
                r.client.complete(job)
                for l in range(LAYERS):
                    for b in range(n * BPC):
                        self.assertEqual(block_at(r.mem, l, dst + b), block_at(r.mem, l, b))
        self.assertEqual(sorted(set(called)), [41 + 2 * i for i in range(len(kinds))])
        lk = sched.lookup_async(keys).result(5)
        self.assertEqual(lk.hits, n)
        # a refused part ends its Pending with the code; nothing is raised at submit
        p = ranks[0].client.retrieve_async(99, keys, [array.array("q", [0] * (n * BPC))])
        with self.assertRaises(kvside.KvsideError) as e:
            p.result(5)
        self.assertEqual(e.exception.code_name, "E_GEOMETRY")
        with self.assertRaises(ValueError):
            ranks[0].client.store_async(100, keys, [["x"] * (n * BPC)])
        with self.assertRaises(ValueError):
            ranks[0].client.store_async(100, keys, [[1 << 64] * (n * BPC)])
        self.assertEqual(sched.stats()["retained_blocks"], 0)

    def test_store_carrying_its_complete(self):
        """store_complete_async on both ranks: one message each, each Pending
        ends with the job's end ("committed"), job_wait agrees on the ranks
        and on the scheduler, and the bytes come back exact."""
        sched = self.client()
        ranks = [Rank(self.srv, r, 2) for r in range(2)]
        for r in ranks:
            self.closers.append(r.close)
        n = 2
        keys = kvside.chunk_keys(NS, tokens(5, n), CHUNK)
        ps = [r.client.store_complete_async(70, keys, [block_ids(0, n)[0]], timeout_ms=10000) for r in ranks]
        self.assertEqual([p.result(10) for p in ps], ["committed", "committed"])
        self.assertEqual(sched.job_wait(70, 5000), "committed")
        for r in ranks:
            self.assertEqual(r.client.job_wait(70, 1000), "committed")
        dst = 40
        ps = [r.client.retrieve_async(71, keys, [block_ids(dst, n)[0]]) for r in ranks]
        self.assertEqual([p.result(5) for p in ps], ["open", "open"])
        for r in ranks:
            r.client.complete(71)
            for l in range(LAYERS):
                for b in range(n * BPC):
                    self.assertEqual(block_at(r.mem, l, dst + b), block_at(r.mem, l, b))
        # a refused part: its error, the job aborted
        p = ranks[0].client.store_complete_async(72, keys, [[10 ** 6] * (n * BPC)])
        with self.assertRaises(kvside.KvsideError) as e:
            p.result(5)
        self.assertEqual(e.exception.code_name, "E_RANGE")
        self.assertEqual(sched.job_wait(72, 5000), "aborted")

    def test_range_of_two_memfds(self):
        """Two memfds registered as one range (the second follows the first):
        a layer view crossing from one into the other stores and retrieves
        byte-exact on both sides of the boundary."""
        sched = self.client(world=1)
        half = 64 * 4096
        a, b = kvside.HostMemory(half), kvside.HostMemory(half)
        for m in (a, b):
            m.view[:] = os.urandom(half)
            self.closers.append(m.close)
        c = kvside.Client("py-eng", NS, rank=0, world=1, broker_dir=self.srv.run, timeout_ms=5000)
        self.closers.append(c.close)
        # 32 blocks of 8 KiB from 128 KiB into a: blocks 16..31 lie in b
        c.register_memory([a, (b.fd, b.size, True)], groups=[kvside.Group(0, "attention", 16, BPC)],
                          layers=[kvside.Layer(0, 0, half // 2, 32, 8192, 8192)])

        def block(i):
            off = half // 2 + i * 8192
            m, off = (a, off) if off < half else (b, off - half)
            return bytes(m.view[off:off + 8192])

        keys = kvside.chunk_keys(NS, tokens(9, 4), CHUNK)
        c.store(1, keys, [list(range(12, 12 + 4 * BPC))])    # blocks 12..27: across the boundary
        c.complete(1)
        self.assertEqual(sched.job_wait(1, 5000), "committed")
        src = [block(i) for i in range(12, 28)]
        c.retrieve(2, keys, [list(range(28, 32)) + list(range(0, 12))])
        c.complete(2)
        got = [block(i) for i in list(range(28, 32)) + list(range(0, 12))]
        self.assertEqual(got, src)

    def test_json_log_lines(self):
        """log-format json: every line of a second server's log is one JSON
        object with an ISO 8601 UTC time, and lines naming a session or a job
        carry its id in a field of its own."""
        import json
        import re
        srv = Server("--log-format", "json", "--log-level", "debug")
        srv.start()
        try:
            with kvside.Client("py-eng", NS, rank=0, world=1, broker_dir=srv.run) as c:
                mem = kvside.HostMemory(REGION)
                c.register_memory([mem], groups=[kvside.Group(0, "attention", TOKENS_PER_BLOCK, BPC)],
                                  layers=[kvside.Layer(0, 0, 0, BLOCKS, STRIDE, BLOCK_BYTES)])
                c.store(77, kvside.chunk_keys(NS, tokens(5, 1), CHUNK), block_ids(0, 1))
                c.complete(77)
                c.job_wait(77, 5000)
                session = "%016x" % c.session
            mem.close()
        finally:
            rc = srv.stop()
            log = open(os.path.join(srv.tmp, "server.log"), errors="replace").read()
            srv.cleanup()
        self.assertEqual(rc, 0)
        lines = [json.loads(line) for line in log.splitlines() if line.strip()]
        self.assertGreater(len(lines), 3)
        for o in lines:
            self.assertRegex(o["time"], r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
            self.assertIn(o["level"], ("error", "warn", "info", "debug"))
            self.assertTrue(o["module"] and isinstance(o["message"], str))
        self.assertTrue(any(o.get("session") == session for o in lines), "no line carries the session id")
        self.assertTrue(any(o.get("job") == "77" for o in lines), "no line carries the job id")
        self.assertFalse(any(re.search(r"session [0-9a-f]{16}", o["message"]) and "session" not in o
                             for o in lines))

    def test_errors_carry_the_code(self):
        r = Rank(self.srv, 0, 1)
        self.closers.append(r.close)
        keys = kvside.chunk_keys(NS, tokens(1, 2), CHUNK)
        with self.assertRaises(kvside.KvsideError) as e:
            r.client.complete(999)
        self.assertEqual(e.exception.code_name, "E_JOB_STATE")
        self.assertEqual(e.exception.code, kvside.E_JOB_STATE)
        self.assertIn("complete", str(e.exception))
        with self.assertRaises(kvside.KvsideError) as e:
            r.client.store(5, keys, [[0, 1, 2, BLOCKS + 5] * 2])
        self.assertEqual(e.exception.code_name, "E_RANGE")
        with self.assertRaises(kvside.KvsideError) as e:
            r.client.store(6, keys, [[0, 1, 2]])
        self.assertEqual(e.exception.code_name, "E_GEOMETRY")
        with self.assertRaises(kvside.KvsideError) as e:
            r.client.retrieve(7, keys, block_ids(40, 2))
        self.assertEqual(e.exception.code_name, "E_MISS")
        sched = self.client(world=1)
        with self.assertRaises(kvside.KvsideError) as e:
            sched.store(8, keys, block_ids(0, 2))
        self.assertEqual(e.exception.code_name, "E_SESSION")
        with self.assertRaises(kvside.KvsideError) as e:
            sched.unregister(12345)
        self.assertEqual(e.exception.code_name, "E_NOREG")
        with self.assertRaises(ValueError):
            sched.lookup(b"short")
        with self.assertRaises(kvside.KvsideError) as e:
            kvside.Client("x", NS, broker_dir=os.path.join(self.srv.tmp, "nobody"), timeout_ms=300)
        self.assertEqual(e.exception.code_name, "ENOENT")  # named at once (test_operator.py has the rest)
        self.assertIn("broker directory %s does not exist" % os.path.join(self.srv.tmp, "nobody"),
                      str(e.exception))
        with self.assertRaises(kvside.KvsideError) as e:
            sched.job_wait(4242, 100)
        self.assertEqual(e.exception.code_name, "E_TIMEOUT")
        # the server is unharmed
        self.assertEqual(sched.stats()["jobs_open"], 0)

    def test_chunk_keys_golden(self):
        # the C library's golden vectors (tests/unit/test_chunkkey.c)
        self.assertEqual([k.hex() for k in kvside.chunk_keys("llama-3-8b:v1", range(1024), 256)], [
            "66e48d15aa71c376e2d245ead377c784574a4b0e3b3349ac346c3e08e5df19cb",
            "38db133f8e5be3c958308c3ab3866eeac66e0d48fd4e2cc7bcd236ec70e62521",
            "233c7eb05f1118603c002ae685174b887b87aac8518eb40faa297586e938a9ad",
            "1cdbea76260c192bf2da2cc52f9ae1b87fb4a5fc24e727a99d25346148689e6f"])
        self.assertEqual([k.hex() for k in kvside.chunk_keys(
            "llama-3-8b:v1", [i * 7 + 3 for i in range(600)], 128)], [
            "9b38471da98512ded74ba0abb69ea63068ace0bdaf175a6982432c7d8338590a",
            "fe65bfdc1d94a4032242384fdda80bd1454615b926051eb5fa02934f77699474",
            "c22ca7a2429bc6eb50393dfc7957f6b45175e6d662150160cf9b250ecba68eff",
            "e61332a59b17c87269fb9a76a8dec18e0e77a4f7f661a3921267d51d49e63734"])
        pat = [0xdeadbeef, 0x01020304, 0xffffffff, 0]
        self.assertEqual([k.hex() for k in kvside.chunk_keys("", [pat[i % 4] for i in range(1200)], 300)], [
            "2eca2b5b64b96f7a8bcb324f0bc5ce08741dedad989bb8f3f1da69ddc3e1916b",
            "3aa6d2fd72c2d39a19273959fcc0e3ecef10334aaa0765b211d1920b1ad2d1b5",
            "c687ebb29cfcc9e9fcb02dd9e9ddb80f51f2ad7a7e0a461a63e12ec22d768e51",
            "9f467b13476c1301483fbd33e02006c68296ba2e06a678c87514a8e9d729ae72"])
        self.assertEqual(kvside.chunk_keys(NS, range(10), 64), [])
        with self.assertRaises(ValueError):
            kvside.chunk_keys(NS, range(10), 0)
        with self.assertRaises(ValueError):
            kvside.chunk_keys(NS, [-1] * 64, 64)
        with self.assertRaises(ValueError):
            kvside.chunk_keys(NS, [1 << 32] * 64, 64)

    def test_reconnect_event_after_restart(self):
        events = []
        c = self.client(on_event=events.append)
        s0 = c.session
        self.srv.stop()
        self.srv.start()
        deadline = time.time() + 10
        while not any(e.type == "reconnected" for e in events) and time.time() < deadline:
            time.sleep(0.05)
        ev = [e for e in events if e.type == "reconnected"]
        self.assertEqual(len(ev), 1)
        self.assertEqual(ev[0].error, 0)
        self.assertNotEqual(c.session, s0)
        self.assertEqual(c.reconnects, 1)
        self.assertGreaterEqual(c.stats()["sessions"], 1)

    def test_admin(self):
        c = self.client()
        self.assertEqual(c.admin("status")["draining"], False)
        d = c.admin("drain", wait_ms=100)
        self.assertTrue(d["draining"] and d["drained"])
        r = Rank(self.srv, 0, 1, engine="adm")
        self.closers.append(r.close)
        with self.assertRaises(kvside.KvsideError) as e:
            r.client.store(1, kvside.chunk_keys(NS, tokens(0, 1), CHUNK), block_ids(0, 1))
        self.assertEqual(e.exception.code_name, "E_BUSY")
        self.assertFalse(c.admin("resume")["draining"])
        self.assertEqual(r.client.store(1, kvside.chunk_keys(NS, tokens(0, 1), CHUNK), block_ids(0, 1)),
                         "open")
        with self.assertRaises(kvside.KvsideError) as e:
            c.admin("clear")
        self.assertEqual(e.exception.code_name, "E_BUSY")
        self.assertIn("jobs open", str(e.exception))
        r.client.complete(1)
        self.assertEqual(r.client.job_wait(1, 5000), "committed")
        self.assertEqual(c.admin("clear")["cleared_l1"], 1)
        with self.assertRaises(ValueError):
            c.admin("reboot")

    def test_cuda_entry_points_without_a_gpu(self):
        if kvside.cuda_available():
            self.skipTest("a CUDA device is present: the GPU suite covers register_cuda")
        c = self.client(role="worker", world=1)
        with self.assertRaises(kvside.KvsideError) as e:
            c.register_cuda([(0x7f0000000000, 1 << 20)], [kvside.Group(0)],
                            [kvside.Layer(0, 0, 0, 16, 65536, 65536)])
        self.assertIn(e.exception.code_name, ("ENODEV", "ENOTSUP", "E_DEVICE"))
        from kvside import torch_alloc  # imports without torch or CUDA
        with self.assertRaises(RuntimeError) as e:
            torch_alloc.allocator()
        self.assertTrue("torch" in str(e.exception) or "CUDA" in str(e.exception), str(e.exception))


if __name__ == "__main__":
    if not SERVER:
        print("KVS_SERVER not set", file=sys.stderr)
        sys.exit(2)
    unittest.main(verbosity=2)
