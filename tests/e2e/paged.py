"""Paged KV cache + kvside glue for the end-to-end tests (model-agnostic).

What lives here, independent of any model:

- ``GroupSpec`` / ``TensorSpec``: a kvside group (full attention, windowed
  attention, recurrent state slots) and the per-layer tensors whose blocks
  form its objects (one kvside layer entry per tensor, e.g. a layer's K and V).
- ``PagedPool``: one TP rank's paged memory: every tensor of every group laid
  out in one flat buffer, exposed as torch tensors of shape
  [num_blocks, *block_shape] (optionally with padded block strides), plus
  the kvside groups and layer views describing it. ``HostPool`` puts it in a
  sealed memfd (kvside.HostMemory); ``CudaPool`` puts it in kvside.torch_alloc
  memory (shareable cuMem) and registers it with ``Client.register_cuda``;
  ``MappedPool`` maps another process's CudaPool (exported as a POSIX fd) into
  this one, so a driver process can fill and read the blocks of its rank
  processes.
- ``BlockAllocator``: free block ids of one group (shuffled per engine, so a
  second engine uses other ids than the first).
- ``block_lists`` / ``needed_chunks``: protocol.md §10 block lists (one list
  per group, ``blocks_per_chunk`` ids per key, the group's null id where the
  engine has no block) and which chunks a retrieve of n chunks writes.
- ``TPConnector``: one worker client per TP rank (threads), registration,
  lookup, and store / retrieve jobs that span every rank (part + complete on
  each rank, then job_wait).
- ``LocalServer``: a real kvside-server in a private directory (optionally
  with an L2 path that survives restarts).
"""

import itertools
import os
import sys
import threading
import time

import numpy as np
import torch

import kvside

# the test server shared by every Python suite
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kvt_server import Server as _Server  # noqa: E402

FULL, WINDOW, RECURRENT = "full", "window", "recurrent"


def _align(x, a):
    return (x + a - 1) // a * a


# ---- layout ---------------------------------------------------------------------------------

class TensorSpec:
    """One paged tensor of a group: blocks of block_shape float32 values. It is
    one kvside layer entry; its block_bytes are copied per block."""

    def __init__(self, name, block_shape, dtype=torch.float32):
        self.name, self.block_shape, self.dtype = name, tuple(block_shape), dtype
        self.elem_size = torch.tensor([], dtype=dtype).element_size()
        self.block_bytes = self.elem_size * int(np.prod(self.block_shape, dtype=np.int64))


class GroupSpec:
    """A kvside group and its tensors.

    kind: FULL (attention, window_chunks -1), WINDOW (attention, window_chunks
    >= 1) or RECURRENT (one state slot per chunk boundary snapshot; a reserved
    null slot). pad_bytes: extra bytes between blocks (block_stride =
    block_bytes + pad_bytes), never copied by kvside."""

    def __init__(self, gid, kind, tokens_per_block, blocks_per_chunk, num_blocks, tensors,
                 window_chunks=-1, null_block=None, pad_bytes=0):
        if kind not in (FULL, WINDOW, RECURRENT):
            raise ValueError("kind must be full, window or recurrent")
        if (kind == WINDOW) != (window_chunks >= 1):
            raise ValueError("window_chunks >= 1 exactly for windowed groups")
        self.gid, self.kind = gid, kind
        self.tokens_per_block, self.blocks_per_chunk = tokens_per_block, blocks_per_chunk
        self.num_blocks, self.tensors = num_blocks, list(tensors)
        self.window_chunks = window_chunks
        # attention: -1 (kvside's default); recurrent: a reserved slot, 0 by default
        self.null_block = null_block if null_block is not None else (0 if kind == RECURRENT else -1)
        self.pad_bytes = pad_bytes

    @property
    def chunk_tokens(self):
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def is_attention(self):
        return self.kind != RECURRENT

    def tensor(self, name):
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def kvside_group(self):
        return kvside.Group(self.gid, "recurrent" if self.kind == RECURRENT else "attention",
                            self.tokens_per_block, self.blocks_per_chunk, self.window_chunks,
                            self.null_block)


def needed_chunks(group, n):
    """Chunks of a prefix of n chunks whose objects a retrieve writes (§10.3)."""
    if group.kind == FULL:
        return list(range(n))
    if group.kind == WINDOW:
        return list(range(max(0, n - group.window_chunks), n))
    return [n - 1] if n > 0 else []


def block_lists(groups, tables, n_chunks):
    """protocol.md §10 block lists for keys[0..n_chunks): one list per group in
    registration order, blocks_per_chunk ids per key. tables[gid] holds the
    engine's ids in chunk order (attention: one per token block; recurrent:
    blocks_per_chunk slots per chunk); entries past its end or None are the
    group's null id. Checks the per-chunk rules (attention chunks all-null or
    all-real, at most one real state slot per recurrent chunk)."""
    out = []
    for g in groups:
        bpc, table = g.blocks_per_chunk, tables.get(g.gid, [])
        ids = [table[i] if i < len(table) and table[i] is not None else g.null_block
               for i in range(n_chunks * bpc)]
        for k in range(n_chunks):
            real = [b for b in ids[k * bpc:(k + 1) * bpc] if b != g.null_block]
            if g.is_attention and real and len(real) != bpc:
                raise ValueError("group %d chunk %d mixes null and real blocks" % (g.gid, k))
            if not g.is_attention and len(real) > 1:
                raise ValueError("group %d chunk %d names %d state slots" % (g.gid, k, len(real)))
        out.append(ids)
    return out


class BlockAllocator:
    """Free block ids of one group; the null id is never handed out. seed
    shuffles the free list so that engines use different ids."""

    def __init__(self, group, seed=0):
        ids = [b for b in range(group.num_blocks) if b != group.null_block]
        g = torch.Generator().manual_seed(seed)
        self.free = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]

    def alloc(self, n=1):
        if n > len(self.free):
            raise RuntimeError("out of blocks")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, ids):
        self.free.extend(i for i in ids if i is not None)


# ---- one rank's memory ----------------------------------------------------------------------

class PagedPool:
    """One TP rank's paged memory: a flat byte buffer (self.flat, a uint8
    torch tensor of self.size bytes, provided by a subclass) in which every
    tensor of every group is one region of [num_blocks] blocks at a 4 KiB-
    aligned offset, block_stride = block_bytes + the group's pad_bytes.
    tensor(gid, name) is a torch view of shape [num_blocks, *block_shape] on
    that memory: what the engine writes there is what the server copies.

    Subclasses allocate the buffer and register it: HostPool (a memfd, CPU
    tensors), CudaPool (kvside.torch_alloc memory, Client.register_cuda with
    the same groups and layer views); MappedPool maps a CudaPool of another
    process (same layout, no registration)."""

    def __init__(self, groups):
        self.groups = list(groups)
        self.entries = []          # (group, tensor spec, offset, stride)
        off = 0
        for g in self.groups:
            for t in g.tensors:
                off = _align(off, 4096)
                stride = _align(t.block_bytes + g.pad_bytes, 16)
                self.entries.append((g, t, off, stride))
                off += g.num_blocks * stride
        self.size = _align(max(off, 1), 4096)
        self.flat = None
        self._views = {}

    def _make_views(self):
        for g, t, off, stride in self.entries:
            inner = list(torch.empty(t.block_shape).stride())
            self._views[(g.gid, t.name)] = self.flat.view(t.dtype).as_strided(
                (g.num_blocks,) + t.block_shape, [stride // t.elem_size] + inner, off // t.elem_size)

    def tensor(self, gid, name):
        return self._views[(gid, name)]

    def fill_random(self, seed):
        """Garbage everywhere (random bytes: NaNs and infinities included), so
        that reading a slot the engine never wrote cannot go unnoticed."""
        g = torch.Generator().manual_seed(seed)
        self.flat.copy_(torch.randint(0, 256, (self.size,), dtype=torch.uint8, generator=g))

    def kvside_groups(self):
        return [g.kvside_group() for g in self.groups]

    def kvside_layers(self, order=None):
        """kvside layer views (offsets in the buffer), group by group; order[gid]
        may list a group's tensor names in another order (the object layout
        follows the registration)."""
        by_name = {(g.gid, t.name): (g, t, off, stride) for g, t, off, stride in self.entries}
        out = []
        for g in self.groups:
            names = (order or {}).get(g.gid) or [t.name for t in g.tensors]
            for n in names:
                _, t, off, stride = by_name[(g.gid, n)]
                out.append(kvside.Layer(g.gid, 0, off, g.num_blocks, stride, t.block_bytes))
        return out

    def register(self, client, order=None):
        raise NotImplementedError

    def object_ranges(self, gid, ids):
        """(offset, length) in the buffer of each piece of the kvside object these
        blocks form: tensor by tensor in the group's order, the blocks in list
        order, block_bytes each (protocol.md §10.2)."""
        return [(off + b * stride, t.block_bytes)
                for g, t, off, stride in self.entries if g.gid == gid for b in ids]

    def object_bytes(self, gid, ids):
        return b"".join(self.flat[o:o + n].cpu().numpy().tobytes()
                        for o, n in self.object_ranges(gid, ids))

    def raw(self):
        """A copy of every byte of the buffer."""
        return self.flat.cpu().numpy().tobytes()

    def close(self):
        self._views.clear()
        self.flat = None


class HostPool(PagedPool):
    """A PagedPool in a sealed memfd (kvside.HostMemory), registered with
    Client.register_memory."""

    def __init__(self, groups, name="kvside-e2e"):
        super().__init__(groups)
        self.mem = kvside.HostMemory(self.size, name=name)
        # numpy holds a buffer export of the mmap: closing it under a live tensor raises
        # (BufferError) instead of unmapping memory a tensor still points to
        self.flat = torch.from_numpy(np.frombuffer(self.mem.buffer, dtype=np.uint8))
        self._make_views()

    def register(self, client, order=None):
        return client.register_memory([self.mem], self.kvside_groups(), self.kvside_layers(order))

    def export(self):
        """(fd, size, offset 0): a new fd of the memfd, for MappedHostPool."""
        return os.dup(self.mem.fd), self.mem.size, 0

    def close(self):
        super().close()
        try:
            self.mem.close()
        except BufferError:
            # a tensor still points into the mapping (e.g. held by a traceback):
            # the mapping goes with the last of them, the memfd at exit
            pass


class _CudaFlat:
    """fill_random on the device (a seeded CUDA generator: no host round trip)."""

    def fill_random(self, seed):
        dev = self.flat.device
        g = torch.Generator(device=dev).manual_seed(seed)
        self.flat.copy_(torch.randint(0, 256, (self.size,), dtype=torch.uint8, generator=g, device=dev))
        torch.cuda.synchronize(dev)


class CudaPool(_CudaFlat, PagedPool):
    """A PagedPool in shareable cuMem device memory from kvside.torch_alloc,
    registered with Client.register_cuda. export() hands the allocation to
    another process (MappedPool)."""

    def __init__(self, groups, device=0):
        super().__init__(groups)
        from kvside import torch_alloc
        self.device = device
        self.flat = torch_alloc.empty((self.size,), dtype=torch.uint8, device=device)
        self._make_views()

    def register(self, client, order=None):
        return client.register_cuda([(self.flat.data_ptr(), self.size)], self.kvside_groups(),
                                    self.kvside_layers(order), device=self.device)

    def export(self):
        """(fd, allocation size, offset of the buffer in it): a new POSIX fd of
        the cuMem allocation behind the buffer (the caller closes it)."""
        import ctypes
        al, base = kvside._Alloc(), ctypes.c_uint64()
        r = kvside._lib.kvs_cuda_export(ctypes.c_void_p(self.flat.data_ptr()), ctypes.byref(al),
                                        ctypes.byref(base))
        if r:
            raise kvside.KvsideError(r, "kvs_cuda_export")
        if al.fd < 0:
            raise RuntimeError("the pool is not cuMem memory (no POSIX fd)")
        return al.fd, al.size, self.flat.data_ptr() - base.value


class CudaMapping:
    """Another process's cuMem allocation, imported from its POSIX fd and
    mapped read-write on device (the CUDA driver API, as kvside-server does).
    tensor(offset, n) is a uint8 torch view of n bytes of it."""

    _cu = None

    @classmethod
    def _lib(cls):
        import ctypes
        if cls._cu is None:
            cu = ctypes.CDLL("libcuda.so.1")
            u64, sz, i32, P = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
            sigs = {
                "cuInit": [ctypes.c_uint], "cuDeviceGet": [ctypes.POINTER(i32), i32],
                "cuDevicePrimaryCtxRetain": [ctypes.POINTER(P), i32], "cuCtxSetCurrent": [P],
                "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), P, i32],
                "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, u64],
                "cuMemMap": [u64, sz, sz, u64, u64],
                "cuMemSetAccess": [u64, sz, P, sz],
                "cuMemUnmap": [u64, sz], "cuMemAddressFree": [u64, sz], "cuMemRelease": [u64],
            }
            for name, args in sigs.items():
                f = getattr(cu, name)
                f.argtypes, f.restype = args, i32
            cls._cu = cu
        return cls._cu

    def __init__(self, fd, size, device=0):
        import ctypes

        class Loc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class Access(ctypes.Structure):
            _fields_ = [("location", Loc), ("flags", ctypes.c_int)]

        cu = self._lib()
        self.size, self.device, self.va, self.h = size, device, None, None

        def ck(r, what):
            if r != 0:
                raise RuntimeError("%s failed: CUresult %d" % (what, r))

        torch.zeros(1, device="cuda:%d" % device)      # torch's primary context exists
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        ck(cu.cuInit(0), "cuInit")
        ck(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        h, va = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        ck(cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1),  # POSIX fd
           "cuMemImportFromShareableHandle")
        self.h = h.value
        try:
            ck(cu.cuMemAddressReserve(ctypes.byref(va), size, 0, 0, 0), "cuMemAddressReserve")
            self.va = va.value
            ck(cu.cuMemMap(self.va, size, 0, self.h, 0), "cuMemMap")
            acc = Access(Loc(1, device), 3)             # device, read-write
            ck(cu.cuMemSetAccess(self.va, size, ctypes.byref(acc), 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    def tensor(self, offset, n):
        if offset < 0 or offset + n > self.size:
            raise ValueError("range outside the mapping")

        class _View:
            pass

        v = _View()
        v.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (self.va + offset, False),
                                      "version": 2, "strides": None}
        return torch.as_tensor(v, device="cuda:%d" % self.device)

    def close(self):
        cu = self._lib()
        if self.va is not None:
            torch.cuda.synchronize()
            cu.cuMemUnmap(self.va, self.size)
            cu.cuMemAddressFree(self.va, self.size)
            self.va = None
        if self.h is not None:
            cu.cuMemRelease(self.h)
            self.h = None


class MappedPool(_CudaFlat, PagedPool):
    """The memory of a CudaPool of another process (same groups, so the same
    layout), mapped here from its export(): this process reads and writes the
    blocks the other one registered."""

    def __init__(self, groups, fd, alloc_size, offset, device=0):
        super().__init__(groups)
        self.mapping = CudaMapping(fd, alloc_size, device)
        self.flat = self.mapping.tensor(offset, self.size)
        self._make_views()

    def close(self):
        super().close()
        self.mapping.close()


class MappedHostPool(PagedPool):
    """The memfd of a HostPool of another process, mapped here (the host
    counterpart of MappedPool, for running the multi-process engine without a
    GPU)."""

    def __init__(self, groups, fd, size, offset=0, device=None):
        import mmap
        super().__init__(groups)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.flat = torch.from_numpy(np.frombuffer(self.map, dtype=np.uint8))[offset:offset + self.size]
        self._make_views()

    def close(self):
        super().close()
        try:
            self.map.close()
        except BufferError:
            pass


# ---- kvside jobs over TP ranks --------------------------------------------------------------

_job_ids = itertools.count(int(time.time() * 1000) % (1 << 40) << 8)


def rank_part(client, op, job, keys, blocks, skip_tokens=0, timeout_ms=20000):
    """One rank's part of a job: store/retrieve, then complete("ok"). A rank
    process of a multi-process engine calls this directly."""
    if op == "store":
        client.store(job, keys, blocks, timeout_ms=timeout_ms)
    else:
        client.retrieve(job, keys, blocks, skip_tokens=skip_tokens, timeout_ms=timeout_ms)
    return client.complete(job, True, timeout_ms=timeout_ms)


class TPConnector:
    """One kvside worker client per TP rank (ranks are threads of this process,
    each with its own session), and jobs spanning every rank."""

    def __init__(self, engine, namespace, world, broker_dir, timeout_ms=20000):
        self.engine, self.namespace, self.world, self.timeout_ms = engine, namespace, world, timeout_ms
        self.clients = []
        try:
            for r in range(world):
                self.clients.append(kvside.Client(engine, namespace, role="worker", rank=r, world=world,
                                                  broker_dir=broker_dir, timeout_ms=timeout_ms))
        except BaseException:
            self.close()
            raise
        self.handles = []

    def register(self, pools, order=None):
        """pools[r] is rank r's pool (anything with register(client, order))."""
        self.handles = [p.register(c, order) for p, c in zip(pools, self.clients)]

    def lookup(self, keys):
        return self.clients[0].lookup(keys, timeout_ms=self.timeout_ms)

    def _job(self, op, keys, blocks, skip_tokens=0, rank_blocks=None):
        """blocks: the lists every rank sends (an engine whose ranks share one
        block table); rank_blocks: one set of lists per rank instead."""
        per_rank = rank_blocks or [blocks] * self.world
        job = next(_job_ids)
        errors = []

        def part(r):
            try:
                rank_part(self.clients[r], op, job, keys, per_rank[r], skip_tokens, self.timeout_ms)
            except Exception as e:  # re-raised on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=part, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        state = self.clients[0].job_wait(job, self.timeout_ms)
        if state != "committed":
            raise RuntimeError("%s job %d ended %s" % (op, job, state))
        return job

    def store(self, keys, blocks, rank_blocks=None):
        return self._job("store", keys, blocks, rank_blocks=rank_blocks)

    def retrieve(self, keys, blocks, skip_tokens=0, rank_blocks=None):
        return self._job("retrieve", keys, blocks, skip_tokens, rank_blocks)

    def stats(self):
        return self.clients[0].stats(timeout_ms=self.timeout_ms)

    def close(self):
        for c, h in zip(self.clients, self.handles):
            try:
                c.unregister(h, timeout_ms=self.timeout_ms)
            except kvside.KvsideError:
                pass
        for c in self.clients:
            c.close()
        self.clients, self.handles = [], []


# ---- a real server --------------------------------------------------------------------------

class LocalServer(_Server):
    """kvside-server in a private temporary directory (tests/python/kvt_server.py);
    l2=True gives it an L2 LMDB directory that stays across stop()/start()."""

    def __init__(self, binary, l2=False, extra=(), l1_size="64M", l2_size="256M"):
        super().__init__(*extra, l2=l2, l1_size=l1_size, l2_size=l2_size, l2_sync=None, binary=binary,
                         ttl_ms=5000, heartbeat_ms=200, prefix="kvt-e2e-")
