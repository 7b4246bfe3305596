"""Mirrors vllm/distributed/kv_transfer/kv_connector/factory.py (vllm-project/vllm @
e578de311c2416e66c6a8b9819586bb91de10f9d, KVConnectorFactory.get_connector_class
B:L96 and create_connector B:L43) for out-of-tree connectors: the class is
``getattr(import_module(kv_connector_module_path), kv_connector)``, it must
accept a ``kv_cache_config`` argument, must be SupportsHMA while the hybrid
KV-cache manager is on, and is built as ``cls(vllm_config, role,
kv_cache_config)``. There is no registry of in-tree connectors here."""

import importlib
import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.logger import init_logger

logger = init_logger(__name__)


def _supports_kw(cls, name):
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class KVConnectorFactory:
    @classmethod
    def get_connector_class(cls, kv_transfer_config):
        name = kv_transfer_config.kv_connector
        if name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        path = kv_transfer_config.kv_connector_module_path
        if path is not None and not path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if not path:
            raise ValueError("Unsupported connector type: %s (the stand-in has no registry: "
                             "set kv_connector_module_path)" % name)
        module = importlib.import_module(path)
        try:
            connector_cls = getattr(module, name)
        except AttributeError as e:
            raise AttributeError("Class %s not found in %s" % (name, path)) from e
        if not _supports_kw(connector_cls, "kv_cache_config"):
            raise ValueError("connector %s does not take kv_cache_config (the 2-argument constructor "
                             "is no longer accepted)" % connector_cls.__name__)
        return connector_cls

    @classmethod
    def create_connector(cls, config, role, kv_cache_config):
        ktc = config.kv_transfer_config
        if ktc is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        connector_cls = cls.get_connector_class(ktc)
        hma_enabled = not config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not supports_hma(connector_cls):
            raise ValueError("connector %s is not SupportsHMA while the hybrid KV-cache manager is on "
                             "(vLLM: --disable-hybrid-kv-cache-manager)" % connector_cls.__name__)
        logger.info("Creating v1 connector with name: %s and engine_id: %s", connector_cls.__name__,
                    ktc.engine_id)
        return connector_cls(config, role, kv_cache_config)
