"""Stand-in for vllm/v1/ (commits in vllm/__init__.py)."""
