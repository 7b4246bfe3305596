#!/usr/bin/env python3
"""Connector cost, measured against the real server (kvside-bench style rows).

1. store / load of one prompt through KvsideConnector (scheduler half and
   worker half driven in vLLM's order) next to the same bytes through raw
   libkvside calls on the same registration, in the same run: GB/s and the
   ratio (goal >= 0.9). --device cuda uses CUDA tensors (plain torch memory:
   legacy IPC; --alloc kvside: kvside.torch_alloc cuMem memory).
2. connector overhead: microseconds per scheduler step (build_connector_meta
   with N running requests in decode) and per request lifecycle (lookup miss,
   update_state_after_alloc, request_finished).

Needs torch and the vLLM stand-in (tests/vllm/stub on PYTHONPATH); KVS_SERVER,
KVSIDE_LIB as for the other Python tests. Prints a markdown table.
"""

import argparse
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import kvside  # noqa: E402
from kvside.vllm import KvsideConnector  # noqa: E402
from test_binding import Server  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

NS = types.SimpleNamespace


def configs(run, args):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    spec = FullAttentionSpec(block_size=args.block, num_kv_heads=args.heads, head_size=args.head,
                             dtype=torch.bfloat16)
    names = ["layer.%d" % i for i in range(args.layers)]
    kcc = NS(num_blocks=args.blocks, kv_cache_groups=[NS(layer_names=names, kv_cache_spec=spec)])
    ktc = NS(engine_id="bench", kv_role="kv_both", is_kv_producer=True, is_kv_consumer=True,
             kv_connector_extra_config={"broker_dir": run, "chunk_tokens": args.chunk})
    vc = NS(kv_transfer_config=ktc, parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
            model_config=NS(model="bench"), cache_config=NS(cache_dtype="bf16", prefix_caching_hash_algo="sha256"))
    return vc, kcc, names


def caches(args, names):
    shape = (args.blocks, args.block, args.heads, 2 * args.head)  # physical NHD page
    out, keep = {}, []
    for n in names:
        if args.device == "cuda":
            if args.alloc == "kvside":
                from kvside import torch_alloc
                t = torch_alloc.empty(shape, dtype=torch.bfloat16, device=0)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            t.normal_()
        else:
            import numpy
            mem = kvside.HostMemory(int(torch.tensor([], dtype=torch.bfloat16).element_size()) *
                                    args.blocks * args.block * args.heads * 2 * args.head)
            keep.append(mem)
            t = torch.from_numpy(numpy.frombuffer(mem.buffer, dtype=numpy.int16)).view(torch.bfloat16).view(shape)
            t.copy_(torch.randn(shape, dtype=torch.float32).to(torch.bfloat16))
        out[n] = t.permute(0, 2, 1, 3)  # logical (nb, H, bs, 2*head)
    return out, keep


def step(so_new=(), cached=None, sched_tokens=None, preempted=(), finished=()):
    cr = cached or NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return NS(scheduled_new_reqs=list(so_new), scheduled_cached_reqs=cr,
              num_scheduled_tokens=sched_tokens or {}, preempted_req_ids=set(preempted),
              finished_req_ids=set(finished))


def hashes(prompt, n):
    return [bytes([prompt & 0xFF, i & 0xFF, i >> 8]) * 11 for i in range(n)][:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--alloc", default="torch", choices=["torch", "kvside"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--running", type=int, default=256)
    args = ap.parse_args()
    nblk = args.tokens // args.block
    args.blocks = 2 * nblk + 8
    # L1 faulted in at start (the test harness turns that off), and one
    # warm-up round not counted: first touches are not the connector's cost
    # every round stores the prompt twice and its lookups pin it: L1 holds them all
    srv = Server("--l1-size", "%dM" % (256 + (2 * (args.reps + 2) * args.tokens * args.layers * args.heads
                                              * args.head * 4 >> 20)),
                 "--prefault", "true")
    srv.start()
    rows = []
    try:
        vc, kcc, names = configs(srv.run, args)
        sched = KvsideConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        work = KvsideConnector(vc, KVConnectorRole.WORKER, kcc)
        kv, keep = caches(args, names)
        work.register_kv_caches(kv)
        cl = work._worker.client
        nbytes = args.tokens * args.layers * args.heads * 2 * args.head * 2
        src, dst = list(range(1, nblk + 1)), list(range(nblk + 1, 2 * nblk + 1))
        verified = []
        res = {"conn store": [], "raw store": [], "conn load": [], "raw load": []}
        for rep in range(args.reps + 1):
            # ---- through the connector
            rid = "p%d" % rep
            req = NS(request_id=rid, num_tokens=args.tokens + 1, block_hashes=hashes(2 * rep, nblk))
            sched.get_num_new_matched_tokens(req, 0)
            sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (src,)), 0)
            meta = sched.build_connector_meta(step([NS(req_id=rid, block_ids=(src,), num_computed_tokens=0)],
                                                   sched_tokens={rid: args.tokens}))
            job = meta.stores[0].job
            work.bind_connector_metadata(meta)
            work.start_load_kv(None)
            t0 = time.perf_counter()
            work.wait_for_save()
            state = cl.job_wait(job, 60000)
            res["conn store"].append(time.perf_counter() - t0)
            if state != "committed":
                log = open(os.path.join(srv.tmp, "server.log"), errors="replace").read()[-3000:]
                raise SystemExit("FAIL: store job %s; worker stats %s; server log:\n%s"
                                 % (state, work._worker.stats, log))
            work.get_finished(set())
            work.clear_connector_metadata()
            sched.request_finished_all_groups(req, (src,))
            req2 = NS(request_id=rid + "b", num_tokens=args.tokens + 1, block_hashes=hashes(2 * rep, nblk))
            t0 = time.perf_counter()
            ext, async_ = sched.get_num_new_matched_tokens(req2, 0)
            while ext is None:  # the lookup's answer is on its way: vLLM asks again next step
                ext, async_ = sched.get_num_new_matched_tokens(req2, 0)
            assert ext == args.tokens and not async_, (ext, async_)
            sched.update_state_after_alloc(req2, NS(get_block_ids=lambda: (dst,)), ext)
            meta = sched.build_connector_meta(step())
            work.bind_connector_metadata(meta)
            work.start_load_kv(None)
            if args.device == "cuda":
                torch.cuda.synchronize()
            res["conn load"].append(time.perf_counter() - t0)
            assert not work.get_block_ids_with_load_errors()
            if rep == 0:  # byte-exact: every layer's destination blocks hold the source blocks
                for name, t in kv.items():
                    if not torch.equal(t[dst].view(torch.int16), t[src].view(torch.int16)):
                        raise SystemExit("FAIL: %s: loaded blocks differ from the stored ones" % name)
                verified.append(len(kv))
            work.get_finished(set())
            work.clear_connector_metadata()
            # ---- the same bytes through raw libkvside calls
            keys = [bytes([0xEE, rep, i]) * 10 + b"\0\0" for i in range(args.tokens // args.chunk)]
            j = 1000 + 10 * rep
            t0 = time.perf_counter()
            cl.store_async(j, keys, [src])
            cl.complete_async(j)
            cl.job_wait(j, 60000)
            res["raw store"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lk = cl.lookup(keys, prefetch=True, pin_ms=10000)
            assert lk.hits == len(keys)
            p = cl.retrieve_async(j + 1, keys, [dst])
            cl.complete_async(j + 1)
            p.result(60)
            res["raw load"].append(time.perf_counter() - t0)
        for what in ("store", "load"):
            c = statistics.median(res["conn " + what][1:])
            r = statistics.median(res["raw " + what][1:])
            rows.append(("%s %d tokens (%s%s)" % (what, args.tokens, args.device,
                                                  "" if args.device == "cpu" else "/" + args.alloc),
                         "%.2f GB/s (%.2f ms)" % (nbytes / c / 1e9, c * 1e3),
                         "%.2f GB/s (%.2f ms)" % (nbytes / r / 1e9, r * 1e3), "%.2f" % (r / c)))
        # ---- overhead per scheduler step and per request
        n = args.running
        reqs = [NS(request_id="d%d" % i, num_tokens=1000, block_hashes=hashes(200 + i, 1000 // args.block))
                for i in range(n)]
        t0 = time.perf_counter()
        for r in reqs:  # the lookups miss: one round trip each
            sched.get_num_new_matched_tokens(r, 0)
            sched.update_state_after_alloc(r, NS(get_block_ids=lambda: (list(range(1, 64)),)), 0)
        per_req_admit = (time.perf_counter() - t0) / n
        sched.build_connector_meta(step([NS(req_id=r.request_id, block_ids=(list(range(1, 64)),),
                                            num_computed_tokens=0) for r in reqs],
                                        sched_tokens={r.request_id: 1000 - 24 for r in reqs}))
        steps, times = 50, []
        for s in range(steps):
            cr = NS(req_ids=[r.request_id for r in reqs], new_block_ids=[None] * n,
                    num_computed_tokens=[976 + s] * n, resumed_req_ids=set())
            t0 = time.perf_counter()
            sched.build_connector_meta(step(cached=cr, sched_tokens={r.request_id: 1 for r in reqs}))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for r in reqs:
            sched.request_finished_all_groups(r, (list(range(1, 64)),))
        per_req_fin = (time.perf_counter() - t0) / n
        rows.append(("scheduler step, %d requests decoding" % n, "%.0f us" % (statistics.median(times) * 1e6),
                     "", ""))
        rows.append(("request admitted (lookup miss + alloc)", "%.0f us" % (per_req_admit * 1e6), "", ""))
        rows.append(("request finished", "%.1f us" % (per_req_fin * 1e6), "", ""))
        work.shutdown()
        sched.shutdown()
    finally:
        srv.stop()
        srv.cleanup()
    print("loads through the connector byte-exact in %d layers (%s)" % (verified[0] if verified else 0,
                                                                        args.device))
    print("| connector bench (%d layers, %d KV heads x %d, bf16, block %d, chunk %d) | connector | raw libkvside | ratio |"
          % (args.layers, args.heads, args.head, args.block, args.chunk))
    print("|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s |" % r)


if __name__ == "__main__":
    main()
