"""Mirrors python/sglang/srt/mem_cache/pool_host/mla.py
(sgl-project/sglang @ 01c0ede38cc9645488fd2847dbea8a2f6a9241d8):
MLATokenToKVPoolHost's buffer shapes per layout (layer_first (L, size, 1,
kv_cache_dim), page_first (size, L, 1, kv_cache_dim), page_first_direct
(page_num, L, page_size, 1, kv_cache_dim)) and its per-token size. Its
get_page_buffer_meta was not read at that commit: it is written after the
same pattern as mha.py's (one pointer per page for the page-major layouts,
one per layer and page for layer_first), which is what the zero-copy
backends of that commit expect of an MLA pool (one slab per page).
"""

from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS


class MLATokenToKVPoolHost(HostKVCache):
    def __init__(self, size, page_size, layout, dtype, layer_num, kv_cache_dim, allocator_type="default"):
        self.kv_cache_dim = kv_cache_dim
        super().__init__(size, page_size, layout, dtype, layer_num, allocator_type)

    def get_size_per_token(self):
        return self.kv_cache_dim * self.itemsize * self.layer_num

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def init_kv_buffer(self):
        if self.layout == "layer_first":
            dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
        elif self.layout == "page_first":
            dims = (self.size, self.layer_num, 1, self.kv_cache_dim)
        elif self.layout == "page_first_direct":
            dims = (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.kv_cache_dim * self.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        alloc_func = ALLOC_MEMORY_FUNCS[self.device]
        return alloc_func(dims, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory,
                          allocator=self.allocator)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index: index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index: index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index: real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return data_page.flatten() if flat else data_page

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    ptr_list.append(base + indices[index] * self.token_stride_size
                                    + layer_id * self.size * self.token_stride_size)
            element_size = self.page_size * self.token_stride_size
        elif self.layout in ["page_first", "page_first_direct"]:
            for index in range(0, len(indices), self.page_size):
                ptr_list.append(base + indices[index] * self.layout_dim)
            element_size = self.page_size * self.layout_dim
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, [element_size] * len(ptr_list)
