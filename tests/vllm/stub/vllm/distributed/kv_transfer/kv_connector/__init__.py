"""Stand-in for vllm/distributed/kv_transfer/kv_connector/ (commits in vllm/__init__.py)."""
