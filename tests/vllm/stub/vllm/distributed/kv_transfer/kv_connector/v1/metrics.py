"""Mirrors vllm/distributed/kv_transfer/kv_connector/v1/metrics.py
(vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d, KVConnectorStats
at L19): a dataclass whose ``data`` dict is what travels from the workers to
the logger; ``reset``/``aggregate``/``reduce``/``is_empty`` are for
subclasses (NotImplementedError here, as in vLLM)."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other):
        raise NotImplementedError

    def reduce(self):
        raise NotImplementedError

    def is_empty(self):
        raise NotImplementedError
