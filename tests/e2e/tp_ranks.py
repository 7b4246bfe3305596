"""TP rank processes for the GPU end-to-end test (issue 14).

Each rank is its own process (multiprocessing, spawn): it allocates its paged
KV memory as a ``paged.CudaPool`` (kvside.torch_alloc, shareable cuMem),
registers it with kvside through its own worker session (rank r of world),
and runs its part of every store / retrieve job. The driver process (the one
running the model) maps each rank's pool through the exported POSIX fd
(``paged.MappedPool``), so it writes the rank's half of the KV heads straight
into the rank's blocks and reads the restored ones back; the ranks never
touch the data themselves.

    ranks = RankGroup(world=2)
    pools = ranks.new_pools(groups, seed)     # MappedPool per rank
    ranks.connect(broker_dir, engine, ns)     # kvside sessions + registration
    ranks.job("store", keys, block_lists)     # one job, every rank's part
    ranks.lookup(keys)
    ranks.disconnect(); ranks.free_pools(); ranks.close()
"""

import itertools
import os
import time
import traceback
from multiprocessing import get_context, reduction

import paged

_job_ids = itertools.count(int(time.time() * 1000) % (1 << 40) << 8 | 0x80)


def rank_main(rank, world, conn, spec):
    """The rank process: commands from the driver over conn, one reply each."""
    import torch

    import kvside

    device = spec.get("device", 0)
    if spec["pool"] == "cuda":
        torch.cuda.set_device(device)
    pool, client, handle = None, None, None

    def disconnect():
        nonlocal client, handle
        if client is not None:
            if handle is not None:
                try:
                    client.unregister(handle, timeout_ms=20000)
                except kvside.KvsideError:
                    pass
            client.close()
        client, handle = None, None

    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        op, args = cmd[0], cmd[1:]
        try:
            if op == "pool":                       # (groups, seed): a new pool, exported
                groups, seed = args
                disconnect()
                pool = None
                pool = (paged.CudaPool(groups, device=device) if spec["pool"] == "cuda" else
                        paged.HostPool(groups, name="e2e-rank%d" % rank))
                pool.fill_random(seed)
                fd, size, off = pool.export()
                conn.send(("ok", (size, off, pool.size)))
                reduction.send_handle(conn, fd, spec["driver_pid"])
                os.close(fd)
                continue
            if op == "free":
                disconnect()
                pool = None
                out = None
            elif op == "connect":                  # (broker_dir, engine, namespace, order)
                broker_dir, engine, namespace, order = args
                disconnect()
                client = kvside.Client(engine, namespace, role="worker", rank=rank, world=world,
                                       broker_dir=broker_dir, timeout_ms=20000)
                handle = pool.register(client, order)
                out = None
            elif op == "disconnect":
                disconnect()
                out = None
            elif op == "job":                      # (op, job, keys, blocks, skip, wait)
                kop, job, keys, blocks, skip, wait = args
                paged.rank_part(client, kop, job, keys, blocks, skip)
                out = client.job_wait(job, 20000) if wait else None
            elif op == "lookup":
                out = tuple(client.lookup(args[0], timeout_ms=20000))
            elif op == "close":
                disconnect()
                pool = None
                conn.send(("ok", None))
                break
            else:
                raise ValueError("unknown command %r" % (op,))
            conn.send(("ok", out))
        except Exception:
            conn.send(("err", "rank %d, %s: %s" % (rank, op, traceback.format_exc())))
    conn.close()


class RankGroup:
    """world rank processes and the driver's end of them."""

    def __init__(self, world, device=0, timeout=120, pool="cuda"):
        """pool: "cuda" (CudaPool in the ranks, MappedPool here) or "host"
        (HostPool / MappedHostPool: the same engine without a GPU)."""
        self.world, self.timeout, self.device, self.kind = world, timeout, device, pool
        spec = {"device": device, "driver_pid": os.getpid(), "pool": pool}
        ctx = get_context("spawn")
        self.conns, self.procs, self.pools = [], [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(r, world, child, spec), daemon=True,
                            name="kvside-rank%d" % r)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def _recv(self, r):
        c = self.conns[r]
        if not c.poll(self.timeout):
            raise RuntimeError("rank %d: no answer in %d s" % (r, self.timeout))
        st, val = c.recv()
        if st != "ok":
            raise RuntimeError(val)
        return val

    def call(self, cmds):
        """cmds[r] to rank r (all sent first: the ranks work concurrently), the
        answers in rank order; the first failure is raised after all answered."""
        for c, cmd in zip(self.conns, cmds):
            c.send(cmd)
        out, err = [], None
        for r in range(self.world):
            try:
                out.append(self._recv(r))
            except RuntimeError as e:
                err = err or e
                out.append(None)
        if err:
            raise err
        return out

    def all(self, *cmd):
        return self.call([cmd] * self.world)

    def new_pools(self, groups, seed):
        """Each rank allocates a CudaPool for groups (garbage from seed); returns
        the driver's MappedPool of each."""
        self.free_pools()
        for r, c in enumerate(self.conns):
            c.send(("pool", groups, seed * 100 + r))
        for r in range(self.world):
            size, off, n = self._recv(r)
            fd = reduction.recv_handle(self.conns[r])
            try:
                mapped = paged.MappedPool if self.kind == "cuda" else paged.MappedHostPool
                self.pools.append(mapped(groups, fd, size, off, self.device))
            finally:
                os.close(fd)
            if self.pools[-1].size != n:
                raise RuntimeError("rank %d: pool of %d bytes, %d expected" % (r, n, self.pools[-1].size))
        return self.pools

    def free_pools(self):
        for p in self.pools:
            p.close()
        if self.pools:
            self.all("free")
        self.pools = []

    def connect(self, broker_dir, engine, namespace, order=None):
        """A kvside worker session per rank (rank r of world) registering its
        pool; order: {gid: tensor names} registers a group's tensors in
        another order (a broken engine, for the negative checks)."""
        self.all("connect", broker_dir, engine, namespace, order)

    def disconnect(self):
        self.all("disconnect")

    def job(self, op, keys, blocks, skip_tokens=0):
        """One kvside job over every rank (each rank: its part + complete; rank 0
        then waits for the job's end). Returns the job id."""
        job = next(_job_ids)
        res = self.call([("job", op, job, keys, blocks, skip_tokens, r == 0) for r in range(self.world)])
        if res[0] != "committed":
            raise RuntimeError("%s job %d ended %s" % (op, job, res[0]))
        return job

    def lookup(self, keys):
        self.conns[0].send(("lookup", keys))
        hits, tiers = self._recv(0)
        return hits, tiers

    def close(self):
        try:
            for p in self.pools:
                p.close()
            self.pools = []
            for c in self.conns:
                try:
                    c.send(("close",))
                except OSError:
                    pass
            for r in range(self.world):
                try:
                    self._recv(r)
                except (RuntimeError, EOFError, OSError):
                    pass
        finally:
            for p in self.procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
