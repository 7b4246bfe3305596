"""Mirrors vllm/v1/kv_cache_interface.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
KVCacheSpec (B:L108), AttentionSpec (B:L184), FullAttentionSpec (B:L235),
MLAAttentionSpec (B:L389), SlidingWindowSpec (B:L559), MambaSpec (B:L710,
with mamba_cache_mode "none" | "align" | "all"), KVCacheTensor (B:L960),
KVCacheGroupSpec (B:L972), KVCacheConfig (B:L987). Page sizes as in vLLM:
attention 2 * block_size * heads * head_size * dtype bytes (or the padded
size), MLA block_size * heads * head_size * dtype bytes, Mamba the sum of
its state tensors (or the padded size). No quantized modes."""

from dataclasses import dataclass, field, replace
from math import prod


def get_dtype_size(dtype):
    import torch
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self):
        raise NotImplementedError

    @property
    def storage_block_size(self):
        return self.block_size

    def copy_with_new_block_size(self, block_size):
        return replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: object
    page_size_padded: int | None = None
    indexes_kv_by_block_stride: bool = False

    @property
    def real_page_size_bytes(self):
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)

    @property
    def page_size_bytes(self):
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.real_page_size_bytes
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: int = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self):
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self):
        return (self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v)
                * get_dtype_size(self.dtype))


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    @property
    def storage_block_size(self):
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self):
        return self.storage_block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    head_size_v: int = None

    def __post_init__(self):
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self):
        return (self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v)
                * get_dtype_size(self.dtype))


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple
    dtypes: tuple
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    @property
    def page_size_bytes(self):
        n = sum(prod(s) * get_dtype_size(d) for s, d in zip(self.shapes, self.dtypes))
        if self.page_size_padded is not None:
            assert self.page_size_padded >= n
            return self.page_size_padded
        return n


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    @property
    def prefix_cacheable_group_ids(self):
        return tuple(range(len(self.kv_cache_groups)))

    @property
    def has_mamba_layers(self):
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)

    @property
    def has_mixed_precision_kv_cache(self):
        return len({g.kv_cache_spec.dtype for g in self.kv_cache_groups
                    if isinstance(g.kv_cache_spec, AttentionSpec)}) > 1

    @property
    def needs_kv_cache_zeroing(self):
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache
