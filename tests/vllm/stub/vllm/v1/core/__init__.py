"""Stand-in for vllm/v1/core/ (commits in vllm/__init__.py)."""
