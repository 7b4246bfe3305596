"""Mirrors vllm/v1/outputs.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d,
KVConnectorOutput at B:L223): what each worker's connector reports per step;
the engine folds the workers' outputs (KVOutputAggregator) before the
scheduler sees them."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self):
        return (not self.finished_sending and not self.finished_recving and not self.kv_connector_stats
                and not self.kv_cache_events and not self.invalid_block_ids
                and not self.kv_connector_worker_meta)
