"""Mirrors python/sglang/srt/mem_cache/storage/mmap/__init__.py."""
from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_mmap, alloc_shm  # noqa: F401
