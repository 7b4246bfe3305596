"""kvside.vllm: vLLM's KV connector for kvside (docs/vllm.md).

Load it in vLLM with ``"kv_connector": "KvsideConnector"`` and
``"kv_connector_module_path": "kvside.vllm"``. Importing this package needs
vLLM (its connector base classes).
"""

from .connector import KvsideConnector, KvsideConnectorMetadata, KvsideConnectorStats

__all__ = ["KvsideConnector", "KvsideConnectorMetadata", "KvsideConnectorStats"]
