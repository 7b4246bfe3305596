"""Mirrors python/sglang/srt/mem_cache/pool_host/base.py
(sgl-project/sglang @ 049f8e64daef5f97982ffd46d89c2277ce260a16): HostKVCache's
sizing (size aligned up to whole pages: page_num = size // page_size + 1),
its allocator choice, and its slot allocator (alloc takes free_slots[:n] of
page-aligned requests, free appends). The device pool is replaced by plain
parameters; the psutil memory check and the device transfer methods are left
out. ``itemsize`` stands for SGLang's ``dtype.itemsize`` (Debian's torch 1.13
has no torch.dtype.itemsize).
"""

import threading

import torch

from sglang.srt.mem_cache.pool_host.common import get_allocator_from_storage


class HostKVCache:
    def __init__(self, size, page_size, layout, dtype, layer_num, allocator_type="default", pin_memory=False,
                 device="cpu"):
        self.page_size = page_size
        self.layout = layout
        self.pin_memory = pin_memory
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.layer_num = layer_num
        self.size_per_token = self.get_size_per_token()
        self.size = size
        self.page_num = self.size // self.page_size + 1
        self.size = self.page_num * self.page_size
        self.kv_buffer = self.init_kv_buffer()
        self.lock = threading.RLock()
        self.clear()

    def clear(self):
        with self.lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, need_size):
        with self.lock:
            assert need_size % self.page_size == 0, "The requested size should be a multiple of the page size."
            if need_size > self.available_size():
                return None
            select_index = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            return select_index

    def free(self, indices):
        with self.lock:
            self.free_slots = torch.cat([self.free_slots, indices.cpu()])
            return len(indices)
