#!/usr/bin/python3
"""Write-behind never refuses a store (issue 16 #6, protocol §10.2): with L2
on and an L1 much smaller than what is stored, pending L2 writes pin their L1
objects; those pins are capped below L1 and give way (oldest job first, its
latest chunks first) when a store needs room. Also: what reaches L2 of a job
is a prefix of its chunks, never later chunks without earlier ones.

Real server, one rank process (this one) with a memfd region, L2 in a temp
directory with fsync on every group commit so the writer falls behind.
Environment as tests/python/test_binding.py."""

import os
import unittest

import kvside
from kvt_server import Server

NS = "wb-model"
TPB, BPC = 16, 4                 # tokens per block, blocks per chunk
CHUNK = TPB * BPC
BLOCKS, BLOCK_BYTES = 256, 64 << 10
REGION = BLOCKS * BLOCK_BYTES    # one layer, 16 MiB
CHUNKS_PER_JOB = 12              # 3 MiB per job (256 KiB objects): queue bounds split jobs
JOBS = 80                        # 240 MiB through a 32 MiB L1


def keys_of(job):
    toks = [job * 1000003 + i for i in range(CHUNKS_PER_JOB * CHUNK)]
    return kvside.chunk_keys(NS, toks, CHUNK)


class WriteBehindTest(unittest.TestCase):
    def test_stores_never_refused_and_l2_holds_prefixes(self):
        srv = Server(l2=True, l1_size="32M", l2_size="1G", l2_sync="full")
        srv.start()
        mem = kvside.HostMemory(REGION, name="kvt-wb")
        try:
            mem.view[:] = os.urandom(REGION)
            c = kvside.Client("wb-eng", NS, role="worker", rank=0, world=1, broker_dir=srv.run, timeout_ms=10000)
            c.register_memory([mem], groups=[kvside.Group(0, "attention", TPB, BPC)],
                              layers=[kvside.Layer(0, 0, 0, BLOCKS, BLOCK_BYTES, BLOCK_BYTES)])
            refused = []
            for job in range(1, JOBS + 1):
                first = (job * CHUNKS_PER_JOB * BPC) % (BLOCKS - CHUNKS_PER_JOB * BPC)
                ids = [[first + i for i in range(CHUNKS_PER_JOB * BPC)]]
                try:
                    c.store(job, keys_of(job), ids)
                    c.complete(job)
                    self.assertEqual(c.job_wait(job, 10000), "committed")
                except kvside.KvsideError as e:
                    refused.append((job, str(e)))
            st = c.stats()
            if os.environ.get("KVT_VERBOSE"):
                print({k: v for k, v in st.items() if k.startswith(("l2_", "l1_nospace"))})
            c.close()
            self.assertEqual(refused, [], "stores refused while L2 wrote behind: %s" % refused[:3])
            self.assertEqual(st["jobs_committed"], JOBS)
            srv.stop()  # flushes what is still queued
            # a restart: only L2 serves; every job's L2 content is a prefix
            srv.start()
            with kvside.Client("probe", NS, role="scheduler", broker_dir=srv.run) as s:
                # lookups need the geometry: it is in L2 (the registration's record)
                prefixes = 0
                for job in range(1, JOBS + 1):
                    keys = keys_of(job)
                    h = s.lookup(keys).hits
                    prefixes += h
                    for j in range(h + 1, CHUNKS_PER_JOB):
                        self.assertEqual(s.lookup(keys[j:j + 1]).hits, 0,
                                         "job %d: chunk %d in L2 without chunk %d" % (job, j, h))
                self.assertGreater(prefixes, 0)
        finally:
            mem.close()
            srv.stop()


if __name__ == "__main__":
    unittest.main()
