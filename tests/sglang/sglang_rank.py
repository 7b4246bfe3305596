"""One SGLang TP rank for tests/sglang/test_backend.py: a process holding
host KV pools (the stand-in MHATokenToKVPoolHost / MLATokenToKVPoolHost in
SGLang's layouts and allocators), one HiCacheController per pool with
kvside.sglang.KvsideStorage attached through SGLang's dynamic backend
factory, and torch.distributed (gloo) as SGLang's TP group, so the hit counts
and acks are reduced across ranks as SGLang does. It runs the phases the test
sends over a pipe and answers with what it saw; every page it fetches is
compared byte for byte with what the storing rank wrote, and every other page
of the pool must be untouched.
"""

import hashlib
import time
import traceback

import torch

PAGE = 4

# name, MLA?, layout, allocator ("shm": SGLang's memfd; "default": its shared anonymous mapping)
SPECS = [("mha-lf", False, "layer_first", "shm"),
         ("mha-pf", False, "page_first", "shm"),
         ("mha-pfd", False, "page_first_direct", "default"),
         ("mla-pf", True, "page_first", "shm")]


def tokens(seed, n_pages, base=None):
    out = list(base or [])
    x = seed * 7919 + 17
    while len(out) < n_pages * PAGE:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x % 50000)
    return out[:n_pages * PAGE]


class Pool:
    def __init__(self, spec, rank, world, extra):
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
        self.name, self.mla, layout, allocator = spec
        self.rank = rank
        size = 600 * PAGE
        if self.mla:
            self.pool = MLATokenToKVPoolHost(size, PAGE, layout, torch.float16, layer_num=3, kv_cache_dim=24,
                                             allocator_type=allocator)
        else:
            self.pool = MHATokenToKVPoolHost(size, PAGE, layout, torch.float16, layer_num=3, head_num=2,
                                             head_dim=8, allocator_type=allocator)
        cfg = dict(extra, allocator=allocator)
        self.ctl = HiCacheController(self.pool, PAGE, torch.distributed.group.WORLD, tp_rank=rank, tp_size=world,
                                     is_mla_model=self.mla, storage_backend="dynamic", model_name="test/tiny-model",
                                     storage_backend_extra_config=cfg)
        self.backend = self.ctl.storage_backend

    # -- page contents

    def expected(self, page_hash, shape):
        """What the storing rank wrote for this page: rank-specific for MHA
        (each rank holds other heads), the same on every rank for MLA."""
        owner = 0 if self.mla else self.rank
        seed = int(hashlib.blake2b(("%s|%d|%s" % (self.name, owner, page_hash)).encode(),
                                   digest_size=7).hexdigest(), 16)
        g = torch.Generator().manual_seed(seed)
        n = 1
        for d in shape:
            n *= d
        return torch.randint(-32768, 32767, (n,), generator=g, dtype=torch.int16).reshape(shape)

    def page(self, index, buf=None):
        if buf is not None:
            saved, self.pool.kv_buffer = self.pool.kv_buffer, buf
        try:
            return self.pool.get_data_page(index, flat=False)
        finally:
            if buf is not None:
                self.pool.kv_buffer = saved

    def fill(self, host_indices, hashes):
        for i, h in enumerate(hashes):
            v = self.page(int(host_indices[i * PAGE]))
            v.copy_(self.expected(h, v.shape).view(v.dtype))

    # -- phases

    def store(self, toks):
        from sglang.srt.mem_cache.utils import get_hash_str
        hashes = get_hash_str(toks, None, page_size=PAGE)
        host = self.pool.alloc(len(hashes) * PAGE)
        assert host is not None, "host pool full"
        self.fill(host, hashes)
        op = self.ctl.write_storage(host, toks, hash_value=hashes)
        self.ctl.run_backup(op)
        self.pool.free(host)
        return op.completed_tokens

    def fetch(self, toks):
        """SGLang's prefetch: hit query (reduced), host pages for the hit,
        transfer (acks reduced); then every fetched page is checked and every
        other page of the pool must be unchanged."""
        op = self.ctl.prefetch("req", toks)
        self.ctl.run_prefetch_query(op)
        hit = op.storage_hit_count
        out = {"hit": hit, "done": 0, "bad_pages": [], "touched_pages": []}
        if hit == 0:
            return out
        host = self.pool.alloc(hit)
        assert host is not None, "host pool full"
        op.host_indices = host
        for i in range(hit // PAGE):  # poison: a page nobody writes cannot pass for a fetched one
            v = self.page(int(host[i * PAGE]))
            v.copy_(torch.full(v.shape, 0x5A5A, dtype=torch.int16).view(v.dtype))
        snapshot = self.pool.kv_buffer.clone()
        self.ctl._page_transfer(op)
        out["done"] = op.completed_tokens
        targets = {}
        for i, h in enumerate(op.hash_value[: op.completed_tokens // PAGE]):
            targets[int(host[i * PAGE]) // PAGE] = h
        for p in range(self.pool.size // PAGE):
            cur = self.page(p * PAGE)
            if p in targets:
                if not torch.equal(cur.contiguous().view(torch.int16), self.expected(targets[p], cur.shape)):
                    out["bad_pages"].append(p)
            elif not torch.equal(cur.contiguous().view(torch.int16),
                                 self.page(p * PAGE, snapshot).contiguous().view(torch.int16)):
                out["touched_pages"].append(p)
        self.pool.free(host)
        return out

    def exists(self, toks):
        from sglang.srt.mem_cache.utils import get_hash_str
        return self.backend.batch_exists(get_hash_str(toks, None, page_size=PAGE))


def main(rank, world, conn, init_file, extra):
    import logging
    logging.basicConfig(level=logging.WARNING, format="rank%d %%(name)s: %%(message)s" % rank)
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    pools = {}

    def on_each(fn):
        return {name: fn(p) for name, p in pools.items()}

    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "quit":
                for p in pools.values():
                    p.backend.close()
                conn.send(("ok", None))
                break
            if cmd == "attach":
                for spec in SPECS:
                    pools[spec[0]] = Pool(spec, rank, world, extra)
                res = on_each(lambda p: {"ns": p.backend.namespace, "engine": p.backend.engine,
                                         "world": p.backend.world})
            elif cmd == "store":
                res = on_each(lambda p: [p.store(t) for t in arg])
            elif cmd == "fetch":
                res = on_each(lambda p: [p.fetch(t) for t in arg])
            elif cmd == "exists":
                res = on_each(lambda p: [p.exists(t) for t in arg])
            elif cmd == "solo_store":
                # only rank 0 backs these pages up: its job must not commit
                p = pools[arg["pool"]]
                res = {"rank": rank}
                if rank == 0:
                    t0 = time.monotonic()
                    res["done"] = p.store(arg["tokens"])
                    res["s"] = time.monotonic() - t0
            elif cmd == "wait_reconnect":
                deadline = time.monotonic() + arg
                while time.monotonic() < deadline and any(
                        p.backend.stats["reconnects"] < 1 for p in pools.values()):
                    time.sleep(0.05)
                res = on_each(lambda p: p.backend.stats["reconnects"])
            elif cmd == "stats":
                res = on_each(lambda p: dict(p.backend.stats))
            else:
                raise ValueError(cmd)
            conn.send(("ok", res))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    torch.distributed.destroy_process_group()
