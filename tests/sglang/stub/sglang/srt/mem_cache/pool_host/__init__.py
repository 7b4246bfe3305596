"""Mirrors python/sglang/srt/mem_cache/pool_host/__init__.py (exports)."""
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: F401
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator, ShmHostTensorAllocator  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: F401
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: F401
