#!/usr/bin/python3
"""KV events (issue 20): a subscriber on the server's kv-events PUB socket
decodes every batch with a decoder written from vLLM's format
(vllm/distributed/kv_events.py at vllm-project/vllm e578de311c24:
KVEventBatch is an array [ts, events, (data_parallel_rank)]; each event a map
tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids,
block_size, lora_id, lora_name, medium, ...}, BlockRemoved {block_hashes,
medium, ...}, AllBlocksCleared {}; multipart (topic, 8-byte big-endian seq,
payload); replay over a ROUTER socket: (b"", start seq) answered by
(b"", topic, seq, payload)... then (b"", b"", seq -1, b"")).

Shown against a real server with L2 and a small L1 and L2: BlockStored
("CPU") with the stored chunk keys after a store commits, BlockStored
("STORAGE") once written behind, BlockRemoved ("CPU") after L1 evictions,
BlockRemoved ("STORAGE") after L2 evictions, AllBlocksCleared after admin
clear; sequence numbers without gaps; a subscriber joining late gets every
missed batch, byte for byte, from the replay socket.
Debian's python3 with python3-zmq and python3-msgpack."""

import os
import sys
import time
import unittest

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(__file__))
import kvside  # noqa: E402
from test_binding import NS, Server  # noqa: E402

BLOCK, BPC, BLOCKS = 64 << 10, 4, 256          # 256 KiB per chunk object
TOPIC = b"kvside-test"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode_batch(payload):
    """vLLM's KVEventBatch, decoded from msgpack by its declared shape."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    ts, events = batch[0], batch[1]
    assert isinstance(ts, float)
    out = []
    for ev in events:
        kind = ev["type"]
        if kind == "BlockStored":
            for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name",
                      "medium"):
                assert f in ev, (f, ev)
            out.append((kind, ev["medium"], [bytes(h) for h in ev["block_hashes"]], ev["block_size"]))
        elif kind == "BlockRemoved":
            out.append((kind, ev["medium"], [bytes(h) for h in ev["block_hashes"]], None))
        elif kind == "AllBlocksCleared":
            out.append((kind, None, [], None))
        else:
            raise AssertionError("unknown event type %r" % kind)
    return out


class Subscriber:
    def __init__(self, ctx, endpoint):
        self.s = ctx.socket(zmq.SUB)
        self.s.setsockopt(zmq.SUBSCRIBE, b"")
        self.s.connect(endpoint)
        self.batches = []   # (seq, payload)

    def drain(self, until, timeout=10.0):
        """Receives until until(events) holds; returns every event so far."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if until(self.events()):
                break
            if self.s.poll(100):
                topic, seq, payload = self.s.recv_multipart()
                assert topic == TOPIC
                self.batches.append((int.from_bytes(seq, "big"), payload))
        return self.events()

    def events(self):
        return [e for _, p in self.batches for e in decode_batch(p)]


class KvEvents(unittest.TestCase):
    def test_events_and_replay(self):
        srv = Server("--l1-size", "4M", "--l2-size", "4M", "--l2-sync", "none", "--kv-events-topic",
                     TOPIC.decode())
        pub = "ipc://" + os.path.join(srv.tmp, "ev.pub")
        replay = "ipc://" + os.path.join(srv.tmp, "ev.replay")
        srv.extra += ["--l2-path", os.path.join(srv.tmp, "l2"), "--kv-events", pub, "--kv-events-replay", replay]
        srv.start()
        ctx = zmq.Context()
        try:
            sub = Subscriber(ctx, pub)
            time.sleep(0.3)  # the subscription reaches the server first
            mem = kvside.HostMemory(BLOCKS * BLOCK)
            c = kvside.Client("ev-eng", NS, rank=0, world=1, broker_dir=srv.run, timeout_ms=5000)
            c.register_memory([mem], groups=[kvside.Group(0, "attention", 16, BPC)],
                              layers=[kvside.Layer(0, 0, 0, BLOCKS, BLOCK, BLOCK)])
            keys1 = [bytes([1, i]) * 16 for i in range(4)]
            # the engine's names of these chunks (e.g. vLLM's block hashes):
            # every event about them names them so
            names1 = [bytes([0xE0, i]) * 16 for i in range(4)]
            with self.assertRaises(ValueError):  # one per key (the server checks too: test_jobtable)
                c.store(1, keys1, [list(range(0, 4 * BPC))], event_hashes=names1[:3])
            c.store(2, keys1, [list(range(0, 4 * BPC))], event_hashes=names1)
            c.complete(2)
            self.assertEqual(c.job_wait(2, 5000), "committed")
            raw1, keys1 = keys1, names1

            def has(kind, medium, keys=()):
                """Some event of this kind and medium, and every key among them."""
                def check(evs):
                    mine = [e for e in evs if e[0] == kind and e[1] == medium]
                    return bool(mine) and set(keys) <= {k for e in mine for k in e[2]}
                return check
            evs = sub.drain(has("BlockStored", "CPU", keys1))
            stored = [e for e in evs if e[0] == "BlockStored" and e[1] == "CPU"]
            self.assertTrue(stored, evs)
            self.assertEqual({k for e in stored for k in e[2]}, set(keys1))
            self.assertEqual({e[3] for e in stored}, {16 * BPC})
            evs = sub.drain(has("BlockStored", "STORAGE", keys1))
            self.assertTrue(has("BlockStored", "STORAGE", keys1)(evs), "no L2 BlockStored: %s" % evs)
            self.assertEqual({e[3] for e in evs if e[0] == "BlockStored"}, {16 * BPC})

            # more chunks than L1 (16 objects) and L2 (4 MiB) hold: both evict
            def drained():
                # pending L2 writes pin their L1 objects (issue 16 #6): a small L1
                # refuses stores until the writer caught up
                deadline = time.time() + 10
                while c.stats().get("l2_queue_depth", 0) and time.time() < deadline:
                    time.sleep(0.02)
            job = 10
            for round_ in range(8):
                drained()
                ks = [bytes([2, round_, i]) * 10 + b"xx" for i in range(4)]
                for attempt in range(20):  # the writer's batch in flight still pins
                    job += 1
                    try:
                        c.store(job, ks, [list(range(0, 4 * BPC))])
                        break
                    except kvside.KvsideError as e:
                        self.assertEqual(e.code_name, "E_NOSPACE")
                        time.sleep(0.05)
                c.complete(job)
                self.assertEqual(c.job_wait(job, 5000), "committed")
            evs = sub.drain(lambda evs: has("BlockRemoved", "CPU")(evs) and has("BlockRemoved", "STORAGE")(evs))
            removed_l1 = {k for e in evs if e[0] == "BlockRemoved" and e[1] == "CPU" for k in e[2]}
            removed_l2 = {k for e in evs if e[0] == "BlockRemoved" and e[1] == "STORAGE" for k in e[2]}
            self.assertTrue(removed_l1, "no BlockRemoved for L1 evictions")
            self.assertTrue(removed_l2, "no BlockRemoved for L2 evictions")
            st = c.stats()
            self.assertGreater(st["l1_evictions"], 0)
            self.assertGreater(st["l2_evictions"], 0)
            stored_any = {k for e in evs if e[0] == "BlockStored" for k in e[2]}
            self.assertTrue(removed_l1 <= stored_any, "a chunk removed that was never stored")
            # the oldest chunks, stored under the engine's names, leave L1 under them
            self.assertTrue(set(names1) & removed_l1, "names1 not among the L1 removals")
            self.assertFalse({k for e in evs for k in e[2]} & set(raw1), "a chunk key published for a named chunk")

            # wait for the write-behind queue, then clear
            deadline = time.time() + 10
            while c.stats().get("l2_queue_depth", 0) and time.time() < deadline:
                time.sleep(0.05)
            c.admin("clear")
            evs = sub.drain(lambda evs: any(e[0] == "AllBlocksCleared" for e in evs))
            self.assertTrue(any(e[0] == "AllBlocksCleared" for e in evs))

            seqs = [s for s, _ in sub.batches]
            self.assertEqual(seqs, list(range(seqs[0], seqs[0] + len(seqs))), "gaps in the sequence")

            # a late subscriber: every missed batch from the replay socket
            r = ctx.socket(zmq.DEALER)
            r.connect(replay)
            r.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            deadline = time.time() + 10
            while time.time() < deadline:
                self.assertTrue(r.poll(5000), "replay did not answer")
                frames = r.recv_multipart()
                self.assertEqual(frames[0], b"")
                if frames[2] == END_SEQ:
                    break
                self.assertEqual(frames[1], TOPIC)
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
            self.assertEqual(got[:len(sub.batches)], sub.batches)
            # and from a later sequence number only the rest
            r.send_multipart([b"", seqs[-1].to_bytes(8, "big")])
            frames = r.recv_multipart()
            self.assertEqual(int.from_bytes(frames[2], "big"), seqs[-1])
            r.close(0)
            c.close()
            mem.close()
        finally:
            ctx.destroy(0)
            rc = srv.stop()
            srv.cleanup()
        self.assertEqual(rc, 0)

    def test_bad_endpoint_refused_at_start(self):
        import subprocess
        r = subprocess.run([os.environ["KVS_SERVER"], "--kv-events", "bogus://x", "--metrics-listen", "off",
                            "--broker-dir", "/tmp/kvt-ev-bad-%d" % os.getpid(), "--l1-size", "4M", "--no-prefault"],
                           capture_output=True, text=True, timeout=20)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("kv-events", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
