"""Mirrors python/sglang/srt/mem_cache/storage/__init__.py (exports the factory)."""
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
