"""Stand-in for vllm/distributed/kv_transfer/ (commits in vllm/__init__.py)."""
