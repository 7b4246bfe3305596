"""Mirrors python/sglang/srt/mem_cache/pool_host/mamba.py
(sgl-project/sglang @ 02f0c2a0f8e4540dd6484b74f3d5b4ea4509f206, the copy read,
none at 001067ff being available): MambaPoolHost,
the host pool of a hybrid model's Mamba/GDN states. One slot per request
state (page_size 1); page-first layouts only (page_first, page_first_direct):
a temporal (SSM) buffer (size, L, 1, *temporal_shape) and one conv buffer
(size, L, 1, *conv_shape) per conv state, each its own host allocation
(ALLOC_MEMORY_FUNCS with the pool's allocator: separate memfds under
"allocator": "shm"); get_page_buffer_meta gives per slot the temporal pointer
(left out for conv-only models) then each conv pointer, each covering all
Mamba layers of that slot; get_data_page concatenates them; alloc / free with
release slots merged back on demand. The device pool (MambaPool) is replaced
by its shapes and dtypes as parameters (``host_size``: slots before SGLang's
+1 page); the host-memory budget check, the NPU paths, the staging buffers and
the device transfer kernels are left out. ``_itemsize`` stands for SGLang's
``dtype.itemsize`` (Debian's torch 1.13 has none).
"""

import threading

import numpy as np
import torch

from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS, get_allocator_from_storage


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


class MambaPoolHost(HostKVCache):
    def __init__(self, num_mamba_layers, conv_state_shapes, temporal_state_shape, conv_dtype, temporal_dtype,
                 host_size, pin_memory=False, device="cpu", allocator_type="default", layout="page_first"):
        self.page_size = 1
        assert layout in ["page_first", "page_first_direct"], f"Unsupported layout: {layout}"
        self.layout = layout
        self.pin_memory = pin_memory
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)
        self.num_mamba_layers = num_mamba_layers
        self.conv_state_shapes = [tuple(s) for s in conv_state_shapes]
        self.temporal_state_shape = tuple(temporal_state_shape)
        self.temporal_state_elem_size = int(np.prod(self.temporal_state_shape))
        self.conv_state_elem_sizes = [int(np.prod(s)) for s in self.conv_state_shapes]
        self.conv_dtype = conv_dtype
        self.temporal_dtype = temporal_dtype
        self.dtype = self.conv_dtype
        self.size_per_token = self.get_size_per_token()
        self.size = int(host_size)
        self.page_num = self.size // self.page_size + 1
        self.size = self.page_num * self.page_size
        self.kv_buffer = self.init_kv_buffer()
        self.lock = threading.RLock()
        self.clear()

    def init_kv_buffer(self):
        _host_alloc = ALLOC_MEMORY_FUNCS[self.device]

        def alloc_func(dims, *, dtype, device, pin_memory, allocator):
            # conv-only linear attention has no ssm state: mmap can't map the
            # 0-element temporal buffer, so hand back a plain empty tensor.
            if np.prod(dims) == 0:
                return torch.empty(dims, dtype=dtype, device=device)
            return _host_alloc(dims, dtype=dtype, device=device, pin_memory=pin_memory, allocator=allocator,
                               registration_granularity_bytes=int(np.prod(dims[1:])) * _itemsize(dtype))

        # page-first: (page_num, num_layers, 1, *shape) — per-page data is contiguous
        temporal_dims = (self.size, self.num_mamba_layers, 1) + self.temporal_state_shape
        self.temporal_buffer = alloc_func(temporal_dims, dtype=self.temporal_dtype, device=self.device,
                                          pin_memory=self.pin_memory, allocator=self.allocator)
        self.conv_buffer = []
        for conv_shape in self.conv_state_shapes:
            conv_dims = (self.size, self.num_mamba_layers, 1) + conv_shape
            self.conv_buffer.append(alloc_func(conv_dims, dtype=self.conv_dtype, device=self.device,
                                               pin_memory=self.pin_memory, allocator=self.allocator))
        return [buf for buf in (self.temporal_buffer, *self.conv_buffer) if buf.numel() > 0]

    def get_hybrid_pool_buffer(self):
        return [self.temporal_buffer, *self.conv_buffer]

    def _iter_page_tensors(self, index):
        yield self.temporal_buffer[index]
        for conv_buf in self.conv_buffer:
            yield conv_buf[index]

    @staticmethod
    def _flatten_tensor_bytes(tensor):
        return tensor.contiguous().view(torch.uint8).reshape(-1)

    def clear(self):
        with self.lock:
            self.mem_state = torch.zeros((self.size,), dtype=torch.uint8, device=self.device)
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.release_slots = []
            self.num_release_slots = 0

    def _merge_release_slots(self):
        if self.release_slots:
            self.free_slots = torch.cat([self.free_slots] + self.release_slots)
            self.release_slots = []
            self.num_release_slots = 0

    def available_size(self):
        return len(self.free_slots) + self.num_release_slots

    def alloc(self, need_size):
        with self.lock:
            assert need_size % self.page_size == 0, "The requested size should be a multiple of the page size."
            if need_size > self.available_size():
                return None
            if need_size > len(self.free_slots):
                self._merge_release_slots()
            select_index = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            return select_index

    def free(self, indices):
        with self.lock:
            indices_cpu = indices.cpu()
            if indices_cpu.numel() == 0:
                return 0
            self.release_slots.append(indices_cpu)
            self.num_release_slots += len(indices_cpu)
            return len(indices)

    def get_size_per_token(self):
        conv_total_size = sum(e * _itemsize(self.conv_dtype) for e in self.conv_state_elem_sizes)
        temporal_size = self.temporal_state_elem_size * _itemsize(self.temporal_dtype)
        return (conv_total_size + temporal_size) * self.num_mamba_layers

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def get_data_page(self, index, flat=True):
        data_page = torch.cat([self._flatten_tensor_bytes(t) for t in self._iter_page_tensors(index)])
        return data_page.flatten() if flat else data_page

    def get_page_buffer_meta(self, indices):
        """Meta data for zero-copy storage I/O (page-first layouts only)."""
        assert len(indices) % self.page_size == 0
        if self.layout not in ["page_first", "page_first_direct"]:
            raise ValueError(f"Mamba storage zero-copy requires page_first layout, got {self.layout}")
        indices = indices.tolist()
        ptr_list = []
        element_size_list = []
        temporal_base_ptr = self.temporal_buffer.data_ptr()
        conv_base_ptrs = [buf.data_ptr() for buf in self.conv_buffer]
        temporal_element_size = (self.page_size * self.num_mamba_layers * _itemsize(self.temporal_dtype)
                                 * self.temporal_state_elem_size)
        conv_element_sizes = [self.page_size * self.num_mamba_layers * _itemsize(self.conv_dtype)
                              * self.conv_state_elem_sizes[i] for i in range(len(self.conv_state_shapes))]
        for i in range(0, len(indices), self.page_size):
            # temporal first (dropped for conv-only models), then conv_0..conv_n
            if self.temporal_state_elem_size > 0:
                ptr_list.append(temporal_base_ptr + indices[i] * self.num_mamba_layers
                                * self.temporal_state_elem_size * _itemsize(self.temporal_dtype))
                element_size_list.append(temporal_element_size)
            for j in range(len(self.conv_buffer)):
                ptr_list.append(conv_base_ptrs[j] + indices[i] * self.num_mamba_layers
                                * self.conv_state_elem_sizes[j] * _itemsize(self.conv_dtype))
                element_size_list.append(conv_element_sizes[j])
        return ptr_list, element_size_list
