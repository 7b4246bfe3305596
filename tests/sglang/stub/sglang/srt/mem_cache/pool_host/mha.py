"""Mirrors python/sglang/srt/mem_cache/pool_host/mha.py
(sgl-project/sglang @ 0047d999bb3a3ad311df5a4b6356bfb5586e0d66):
MHATokenToKVPoolHost's buffer shapes per layout (init_kv_buffer: layer_first
(2, L, size, H, D), page_first (2, size, L, H, D), page_first_direct
(2, page_num, L, page_size, H, D), page_head (2, page_num, H, page_size, L,
D)), get_data_page and get_page_buffer_meta (the zero-copy page pointers: per
page, K and V of each layer for layer_first, else one K and one V slab), with
the same formulas. Transfer kernels are left out.
"""

from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS


class MHATokenToKVPoolHost(HostKVCache):
    def __init__(self, size, page_size, layout, dtype, layer_num, head_num, head_dim, allocator_type="default"):
        self.head_num, self.head_dim = head_num, head_dim
        super().__init__(size, page_size, layout, dtype, layer_num, allocator_type)

    def get_size_per_token(self):
        return self.head_dim * self.head_num * self.layer_num * self.itemsize * 2

    def get_ksize_per_token(self):
        return self.get_size_per_token() // 2

    def init_kv_buffer(self):
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_head":
            dims = (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.head_num * self.head_dim * self.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        alloc_func = ALLOC_MEMORY_FUNCS[self.device]
        return alloc_func(dims, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory,
                          allocator=self.allocator)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index: index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index: index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index: real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * self.itemsize
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (kv_buffer_data_ptr
                             + indices[index] * self.head_num * self.head_dim * self.itemsize
                             + layer_id * self.size * self.head_num * self.head_dim * self.itemsize)
                    v_ptr = k_ptr + v_offset
                    ptr_list.append(k_ptr)
                    ptr_list.append(v_ptr)
            element_size = self.itemsize * self.page_size * self.head_num * self.head_dim
            element_size_list = [element_size] * len(ptr_list)
        elif self.layout in ["page_first", "page_first_direct", "page_head"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = (kv_buffer_data_ptr
                         + indices[index] * self.layer_num * self.head_num * self.head_dim * self.itemsize)
                v_ptr = k_ptr + v_offset
                ptr_list.append(k_ptr)
                ptr_list.append(v_ptr)
            element_size = self.layer_num * self.itemsize * self.page_size * self.head_num * self.head_dim
            element_size_list = [element_size] * len(ptr_list)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, element_size_list
