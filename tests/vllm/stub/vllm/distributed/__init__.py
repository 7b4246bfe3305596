"""Stand-in for vllm/distributed/ (see vllm/__init__.py for the commits)."""
