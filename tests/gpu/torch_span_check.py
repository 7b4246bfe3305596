"""Per-layer KV tensors allocated by plain PyTorch with expandable segments
(issue 19): PyTorch maps one tensor over several cuMem allocations, which
libkvside-preload.so makes exportable. kvside.Client.register_cuda finds
every allocation under each tensor and registers them as one range; the
server maps them back to back, so blocks crossing an allocation boundary are
stored and retrieved byte-exact, and again from L2 after a server restart
(the library re-registers by itself).

Run: LD_PRELOAD=.../libkvside-preload.so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
     KVS_SERVER=... KVSIDE_LIB=... PYTHONPATH=worker/python:tests/python python3 torch_span_check.py
Exit 0 on success, 1 on a failure, 77 without CUDA."""
import ctypes
import os
import sys
import time

import torch

import kvside
from test_binding import Server

if not torch.cuda.is_available() or not kvside.cuda_available():
    print("SKIP: no CUDA")
    sys.exit(77)

# 85 blocks of 768 KiB per layer tensor (63.75 MiB): PyTorch maps 20 MiB pieces,
# so some blocks straddle two allocations
LAYERS, BLOCKS, BLOCK = 4, 85, 768 << 10
CHUNK_BLOCKS = 4
NS = "span-check"


def pieces(ptr, size):
    """The allocations under [ptr, ptr + size) as libkvside finds them."""
    lib = ctypes.CDLL(kvside.library())
    out, at = [], ptr
    while at < ptr + size:
        a, base = kvside._Alloc(), ctypes.c_uint64()
        rc = lib.kvs_cuda_export(ctypes.c_void_p(at), ctypes.byref(a), ctypes.byref(base))
        if rc:
            raise SystemExit("FAIL: kvs_cuda_export at 0x%x: %d" % (at, rc))
        if a.fd >= 0:
            os.close(a.fd)
        out.append((base.value, a.size))
        at = base.value + a.size
    return out


def main():
    layers = [torch.empty(BLOCKS * BLOCK, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    spans = [pieces(t.data_ptr(), t.numel()) for t in layers]
    print("torch %s, LD_PRELOAD=%s, %s: layer tensors over %s allocations" % (
        torch.__version__, "yes" if "kvside-preload" in os.environ.get("LD_PRELOAD", "") else "no",
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), [len(s) for s in spans]))
    # the blocks that cross an allocation boundary
    crossing = set()
    for t, sp in zip(layers, spans):
        for base, size in sp[:-1]:
            end = base + size - t.data_ptr()
            if 0 < end < t.numel() and end % BLOCK:
                crossing.add(end // BLOCK)
    if max(len(s) for s in spans) < 2:
        print("FAIL: no layer tensor spans several allocations (nothing to check)")
        return 1
    g = torch.Generator(device="cuda").manual_seed(7)
    for t in layers:
        t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, device="cuda", generator=g))
    torch.cuda.synchronize()
    view = [t.view(BLOCKS, BLOCK) for t in layers]
    srv = Server("--l1-size", "2G")
    srv.extra += ["--l2-path", os.path.join(srv.tmp, "l2"), "--l2-size", "4G", "--l2-sync", "none"]
    srv.start()
    ok = True
    try:
        c = kvside.Client("span", NS, rank=0, world=1, broker_dir=srv.run, timeout_ms=10000)
        c.register_cuda([(t.data_ptr(), t.numel()) for t in layers],
                        [kvside.Group(0, "attention", 16, CHUNK_BLOCKS)],
                        [kvside.Layer(0, i, 0, BLOCKS, BLOCK, BLOCK) for i in range(LAYERS)])
        st = c.stats()
        print("registered: %d imports for %d layer tensors" % (st.get("imports", -1), LAYERS))
        n = 10   # chunks 0..9: blocks 0..39, stored; retrieved into blocks 44..83
        keys = [bytes([9, k]) * 16 for k in range(n)]
        src = list(range(0, n * CHUNK_BLOCKS))
        dst = list(range(44, 44 + n * CHUNK_BLOCKS))
        c.store(1, keys, [src])
        c.complete(1)
        assert c.job_wait(1, 30000) == "committed"

        def check(tag, job):
            for t in view:
                t[dst] = 0
            torch.cuda.synchronize()
            c.retrieve(job, keys, [dst])
            c.complete(job)
            torch.cuda.synchronize()
            bad = sum(int(not torch.equal(v[dst[i]], v[src[i]])) for v in view for i in range(len(src)))
            cross = sorted(b for b in crossing if b in src or b in dst)
            print("%s: %d blocks x %d layers retrieved, %d differ; blocks crossing an allocation boundary "
                  "among them: %s" % (tag, len(src), LAYERS, bad, cross))
            return bad == 0 and bool(cross)

        ok &= check("L1", 2)
        # restart: L2 written first; the library re-registers by itself
        deadline = time.time() + 30
        while c.stats().get("l2_queue_depth", 0) and time.time() < deadline:
            time.sleep(0.05)
        srv.stop()
        srv.start()
        deadline = time.time() + 30
        while c.reconnects == 0 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        lk = c.lookup(keys)
        print("after restart: reconnects %d, lookup %d hits, tiers %s" % (c.reconnects, lk.hits, sorted(set(lk.tiers))))
        ok &= lk.hits == n and check("L2", 3)
        c.close()
    finally:
        rc = srv.stop()
        srv.cleanup()
    print("PASS" if ok and rc == 0 else "FAIL (server exit %s)" % rc)
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
