"""Mirrors python/sglang/srt/mem_cache/storage/mmap/mmap_allocator.py
(sgl-project/sglang @ 13e4fbf9212e6808f0db71fe82acf3189126fc99): the two host
allocations HiCache pools come from.

- alloc_mmap: the default allocator's memory, a MAP_SHARED | MAP_ANONYMOUS
  mapping pre-faulted (MADV_POPULATE_WRITE, else MAP_POPULATE) and wrapped by
  torch.frombuffer (hugepages, SGLANG_HUGEPAGE_SIZE, are left out);
- alloc_shm: the "shm" allocator's memory, a memfd created with MFD_CLOEXEC
  only (so it carries F_SEAL_SEAL and cannot be sealed against shrinking),
  falling back to an unlinked /dev/shm file; the caller keeps the fd open.
"""

import math
import mmap
import os
import uuid

import torch

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x08000)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _mmap_prefaulted(fileno: int, alloc_bytes: int, flags: int) -> mmap.mmap:
    try:
        mm = mmap.mmap(fileno, alloc_bytes, flags=flags, prot=_PROT_RW)
        mm.madvise(_MADV_POPULATE_WRITE)
        return mm
    except (OSError, ValueError):
        return mmap.mmap(fileno, alloc_bytes, flags=flags | _MAP_POPULATE, prot=_PROT_RW)


def alloc_mmap(dims: tuple, dtype: torch.dtype) -> torch.Tensor:
    n_bytes = math.prod(dims) * torch.empty([], dtype=dtype).element_size()
    alloc_bytes = math.ceil(n_bytes / mmap.PAGESIZE) * mmap.PAGESIZE
    mm = _mmap_prefaulted(-1, alloc_bytes, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=dtype, count=math.prod(dims)).reshape(dims)


def alloc_shm(dims: tuple, dtype: torch.dtype):
    n_bytes = math.prod(dims) * torch.empty([], dtype=dtype).element_size()
    alloc_bytes = math.ceil(n_bytes / mmap.PAGESIZE) * mmap.PAGESIZE
    fd = None
    try:
        fd = os.memfd_create(f"sglang_host_pool_{uuid.uuid4().hex}", flags=getattr(os, "MFD_CLOEXEC", 1))
    except (AttributeError, OSError):
        shm_path = f"/dev/shm/sglang_host_pool_{uuid.uuid4().hex}.mmap"
        fd = os.open(shm_path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.unlink(shm_path)
        except OSError:
            pass
    try:
        os.ftruncate(fd, alloc_bytes)
        mm = _mmap_prefaulted(fd, alloc_bytes, mmap.MAP_SHARED)
    except Exception:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mm, dtype=dtype, count=math.prod(dims)).reshape(dims)
    return tensor, fd, mm
