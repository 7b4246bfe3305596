"""Mirrors vllm/distributed/kv_transfer/kv_connector/v1/__init__.py (vllm-project/vllm @
e578de311c2416e66c6a8b9819586bb91de10f9d): re-exports of base.py."""

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                               SupportsHMA, supports_hma)

__all__ = ["KVConnectorRole", "KVConnectorBase_V1", "supports_hma", "SupportsHMA"]
