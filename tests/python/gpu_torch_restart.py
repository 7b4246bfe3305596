#!/usr/bin/env python3
"""GPU check of kvside.torch_alloc (run on a CUDA machine with PyTorch):

  2 rank processes allocate their KV cache as torch tensors through
  kvside.torch_alloc (shareable cuMem memory from libkvside), register them,
  store 4 chunks (L2 enabled) -> the server is restarted -> 2 new rank
  processes allocate other tensors the same way, look the chunks up (from L2),
  retrieve them into other blocks, and compare byte for byte with the data
  the first ranks stored; blocks outside the destinations stay zero.

Environment: KVS_SERVER, KVSIDE_LIB, PYTHONPATH=worker/python.
Usage: gpu_torch_restart.py            (the driver)
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NS = "torch-model"
WORLD = 2
LAYERS, BLOCKS, BLOCK_BYTES = 4, 64, 64 << 10
TPB, BPC = 16, 4
N_KEYS = 4


def rank_main(phase, rank, run_dir):
    import torch
    import kvside
    from kvside import torch_alloc

    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
        torch_alloc.use_globally()  # before any CUDA allocation of this process
    kv = torch_alloc.empty((LAYERS, BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device=0)
    g = torch.Generator().manual_seed(1234 + rank)
    src = torch.randint(0, 256, (LAYERS, BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=g)
    if phase == "store":
        kv.copy_(src)
    else:
        kv.zero_()
    torch.cuda.synchronize()
    keys = kvside.chunk_keys(NS, [1000 + 7 * i for i in range(N_KEYS * TPB * BPC)], TPB * BPC)
    with kvside.Client("torch-eng", NS, rank=rank, world=WORLD, broker_dir=run_dir,
                       timeout_ms=20000) as c:
        handle = torch_alloc.register(
            c, [kv], [kvside.Group(0, "attention", TPB, BPC)],
            [kvside.Layer(0, 0, l * BLOCKS * BLOCK_BYTES, BLOCKS, BLOCK_BYTES, BLOCK_BYTES)
             for l in range(LAYERS)])
        if phase == "store":
            c.store(1, keys, [list(range(N_KEYS * BPC))])
            c.complete(1)
            state = c.job_wait(1, 20000)
            print("rank %d: tensor at 0x%x (%d MiB, kvside allocator), stored %d chunks: %s" %
                  (rank, kv.data_ptr(), kv.numel() >> 20, N_KEYS, state), flush=True)
            ok = state == "committed"
        else:
            lk = c.lookup(keys)
            c.retrieve(2, keys, [list(range(32, 32 + N_KEYS * BPC))])
            c.complete(2)
            state = c.job_wait(2, 20000)
            torch.cuda.synchronize()
            got = kv.cpu()
            same = torch.equal(got[:, 32:32 + N_KEYS * BPC], src[:, :N_KEYS * BPC])
            rest = got.clone()
            rest[:, 32:32 + N_KEYS * BPC] = 0
            untouched = int(rest.count_nonzero()) == 0
            print("rank %d: new tensor at 0x%x, lookup %d hits %s, retrieve %s, byte-exact %s, "
                  "other blocks untouched %s" % (rank, kv.data_ptr(), lk.hits, lk.tiers, state,
                                                  same, untouched), flush=True)
            ok = state == "committed" and lk.hits == N_KEYS and same and untouched
        c.unregister(handle)
    return 0 if ok else 1


def server(run_dir, l2_dir, log):
    p = subprocess.Popen([os.environ["KVS_SERVER"], "--broker-dir", run_dir, "--l2-path", l2_dir,
                          "--l1-size", "1G", "--l2-size", "1G", "--metrics-listen", "off",
                          "--log-level", "info", "--no-prefault"], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(400):
        if os.path.exists(os.path.join(run_dir, "kvside.zmq")):
            time.sleep(0.2)
            return p
        time.sleep(0.05)
    raise RuntimeError("server did not start")


def ranks(phase, run_dir):
    procs = [subprocess.Popen([sys.executable, __file__, phase, str(r), run_dir]) for r in range(WORLD)]
    return all(p.wait(120) == 0 for p in procs)


def main():
    if len(sys.argv) == 4:
        sys.exit(rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
    import torch
    print("torch %s, CUDA %s, device %s" % (torch.__version__, torch.version.cuda,
                                            torch.cuda.get_device_name(0)), flush=True)
    tmp = tempfile.mkdtemp(prefix="kvt-torch-")
    run_dir, l2 = os.path.join(tmp, "run"), os.path.join(tmp, "l2")
    log = open(os.path.join(tmp, "server.log"), "ab")
    ok = False
    try:
        s = server(run_dir, l2, log)
        ok = ranks("store", run_dir)
        s.send_signal(signal.SIGTERM)
        print("server stopped: exit %d (SIGTERM flushes queued L2 writes)" % s.wait(60), flush=True)
        s = server(run_dir, l2, log)
        print("server restarted on the same L2", flush=True)
        ok = ranks("retrieve", run_dir) and ok
        s.send_signal(signal.SIGTERM)
        s.wait(60)
    finally:
        log.close()
        with open(os.path.join(tmp, "server.log"), "rb") as f:
            sys.stdout.write(f.read().decode(errors="replace")[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT: %s" % ("byte-exact after restart" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
