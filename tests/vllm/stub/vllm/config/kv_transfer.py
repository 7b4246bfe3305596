"""Mirrors vllm/config/kv_transfer.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
KVTransferConfig with the fields a connector and the engine read, the same
defaults (``kv_load_failure_policy`` "fail", a uuid4 ``engine_id`` when
unset, ``kv_role`` required with a connector) and the role properties."""

import uuid
from dataclasses import dataclass, field
from typing import Any

_PRODUCER = ("kv_producer", "kv_both")
_CONSUMER = ("kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"   # "recompute" | "fail"

    def __post_init__(self):
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in _PRODUCER + _CONSUMER:
            raise ValueError("Unsupported kv_role: %s" % self.kv_role)
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("Please specify kv_role when kv_connector is set")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")

    @property
    def is_kv_transfer_instance(self):
        return self.kv_connector is not None and self.kv_role in _PRODUCER + _CONSUMER

    @property
    def is_kv_producer(self):
        return self.kv_connector is not None and self.kv_role in _PRODUCER

    @property
    def is_kv_consumer(self):
        return self.kv_connector is not None and self.kv_role in _CONSUMER

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)
