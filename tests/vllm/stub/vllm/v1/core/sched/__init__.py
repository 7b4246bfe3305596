"""Stand-in for vllm/v1/core/sched/ (commits in vllm/__init__.py)."""
