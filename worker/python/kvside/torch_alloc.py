"""Shareable KV-cache memory for PyTorch, allocated by libkvside.

PyTorch's caching allocator uses cudaMalloc, whose memory kvside-server cannot
import across processes the cuMem way (POSIX fds). This module routes
allocations through libkvside's ``kvs_cuda_alloc`` / ``kvs_cuda_free``
(cuMemCreate with a POSIX-fd handle type) via
``torch.cuda.memory.CUDAPluggableAllocator``; tensors made that way can be
registered with :meth:`kvside.Client.register_cuda` (see :func:`register`).

Two ways to use it:

* a private pool for the KV cache only (PyTorch >= 2.5 has
  ``torch.cuda.MemPool``)::

      from kvside import torch_alloc
      kv = torch_alloc.empty((layers, blocks, block_elems), dtype=torch.float16, device=0)

* or the allocator for the whole process, before the first CUDA allocation::

      torch_alloc.use_globally()

torch is imported lazily: importing this module never needs it. Every entry
point raises :class:`RuntimeError` with the reason when torch, CUDA or
libkvside's CUDA allocator is missing.
"""

import ctypes

import kvside

_ALLOC = "kvs_cuda_alloc"
_FREE = "kvs_cuda_free"
_allocator = None
_pools = {}


def _torch():
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("kvside.torch_alloc needs PyTorch (import torch failed: %s)" % e) from None
    if not torch.cuda.is_available():
        raise RuntimeError("kvside.torch_alloc: torch sees no CUDA device")
    if not hasattr(torch.cuda, "memory") or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise RuntimeError("kvside.torch_alloc needs torch.cuda.memory.CUDAPluggableAllocator "
                           "(PyTorch >= 2.0); this is torch %s" % torch.__version__)
    return torch


def _check_symbols():
    path = kvside.library()
    lib = ctypes.CDLL(path)
    missing = [s for s in (_ALLOC, _FREE) if getattr(lib, s, None) is None]
    if missing:
        raise RuntimeError("kvside.torch_alloc: %s has no %s: libkvside was built without CUDA "
                           "support (CUDA headers absent at build time)" % (path, " or ".join(missing)))
    if not kvside.cuda_available():
        raise RuntimeError("kvside.torch_alloc: libkvside finds no usable CUDA driver or device")
    return path


def allocator():
    """The CUDAPluggableAllocator backed by libkvside (created once)."""
    global _allocator
    if _allocator is None:
        torch = _torch()
        path = _check_symbols()
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, _ALLOC, _FREE)
    return _allocator


def use_globally():
    """Makes libkvside's allocator PyTorch's for this process. Must run before
    the process's first CUDA allocation (PyTorch refuses a later switch)."""
    torch = _torch()
    torch.cuda.memory.change_current_allocator(allocator())


def pool(device=0):
    """A torch.cuda.MemPool drawing from libkvside (one per device)."""
    torch = _torch()
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("kvside.torch_alloc.pool needs torch.cuda.MemPool (PyTorch >= 2.5); "
                           "use use_globally() instead")
    if device not in _pools:
        _pools[device] = torch.cuda.MemPool(allocator().allocator())
    return _pools[device]


def empty(shape, dtype=None, device=0):
    """An uninitialised tensor in shareable cuMem memory on device, from the
    libkvside pool (or from the current allocator after use_globally())."""
    torch = _torch()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
        with torch.cuda.use_mem_pool(pool(dev.index or 0), device=dev):
            return torch.empty(shape, dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def register(client, tensors, groups, layers, device=None, timeout_ms=0):
    """Registers CUDA tensors with kvside: tensors are the allocations (layer
    `alloc` indexes them; offsets are bytes from each tensor's first element).
    Returns the registration handle."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("no tensors")
    if device is None:
        device = tensors[0].device.index or 0
    bufs = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError("tensors must be contiguous CUDA tensors")
    return client.register_cuda(bufs, groups, layers, device=device, timeout_ms=timeout_ms)
