"""Mirrors python/sglang/srt/mem_cache/pool_host/common.py
(sgl-project/sglang @ 0269a4c2688038c9de2774e9e0214db324442a8b): the host
tensor allocators and how one is chosen. HostTensorAllocator gives
alloc_mmap's shared anonymous memory, ShmHostTensorAllocator alloc_shm's memfd
(its fds stay open in ``fds``); get_allocator_type picks "shm" when the
backend is "shm", or "dynamic" with ``"allocator": "shm"`` in the extra
config (SGLang reads the server args; here they are parameters). The
cudaHostRegister step (pin_memory) is left out: there is no GPU here.
"""

import json
import os

from sglang.srt.mem_cache.storage.mmap import alloc_mmap


class HostTensorAllocator:
    def __init__(self):
        self.dtype = None
        self.dims = None

    def allocate(self, dims, dtype, device):
        assert device == "cpu"
        self.dtype, self.dims = dtype, dims
        return alloc_mmap(dims, dtype)


class ShmHostTensorAllocator(HostTensorAllocator):
    def __init__(self):
        super().__init__()
        self.fds = []
        self.mms = []

    def allocate(self, dims, dtype, device):
        assert device == "cpu"
        self.dtype, self.dims = dtype, dims
        from sglang.srt.mem_cache.storage.mmap import alloc_shm
        tensor, fd, mm = alloc_shm(dims, dtype)
        self.fds.append(fd)
        self.mms.append(mm)
        return tensor

    def __del__(self):
        for fd in getattr(self, "fds", []):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def get_allocator_from_storage(allocator_type):
    if allocator_type == "shm":
        return ShmHostTensorAllocator()
    return HostTensorAllocator()


def get_allocator_type(hicache_storage_backend, hicache_storage_backend_extra_config):
    backend = hicache_storage_backend
    if backend == "shm":
        return "shm"
    if backend == "dynamic":
        extra_config_str = hicache_storage_backend_extra_config
        if extra_config_str:
            try:
                config = json.loads(extra_config_str)
                if config.get("allocator") == "shm":
                    return "shm"
            except Exception:
                pass
    return backend or "default"


def alloc_with_host_register(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    # pin_memory would cudaHostRegister the buffer here
    return allocator.allocate(dims, dtype=dtype, device=device)


ALLOC_MEMORY_FUNCS = {"cpu": alloc_with_host_register}
