"""Mirrors python/sglang/srt/mem_cache/hybrid_cache/ (package)."""
