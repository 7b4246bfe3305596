"""Mirrors vllm/v1/outputs.py (vllm 0.32.0, KVConnectorOutput with
failed_recving): what each worker's connector reports per step;
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
    failed_recving: set[str] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self):
        return (not self.finished_sending and not self.finished_recving and not self.failed_recving
                and not self.kv_connector_stats
                and not self.kv_cache_events and not self.invalid_block_ids
                and not self.kv_connector_worker_meta)
