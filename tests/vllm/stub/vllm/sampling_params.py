"""Mirrors vllm/sampling_params.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
only ``max_tokens`` and ``extra_args`` (where ``kv_transfer_params`` travel)."""

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int = 16
    extra_args: dict[str, Any] | None = None
