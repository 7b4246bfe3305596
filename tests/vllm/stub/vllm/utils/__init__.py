"""Mirrors the parts of vllm/utils/__init__.py and vllm/utils/math_utils.py
(vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d) used here: ``cdiv``."""


def cdiv(a, b):
    """Ceiling division."""
    return -(a // -b)
