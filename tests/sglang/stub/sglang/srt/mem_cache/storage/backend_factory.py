"""Mirrors python/sglang/srt/mem_cache/storage/backend_factory.py
(sgl-project/sglang @ 001067fffe33427bee0ed2f007fb7551a1d76b44): the lazy
registry and the ``dynamic`` backend, which imports extra_config's
module_path, checks that class_name subclasses HiCacheStorage and constructs
it as ``backend_class(storage_config, kwargs)``. The built-in backends'
registrations are left out (their modules are not part of the stand-in).
"""

import importlib
import logging
from typing import Any, Dict

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

logger = logging.getLogger(__name__)


class StorageBackendFactory:
    """Factory for creating storage backend instances with support for dynamic loading."""

    _registry: Dict[str, Dict[str, Any]] = {}

    @staticmethod
    def _load_backend_class(module_path: str, class_name: str, backend_name: str):
        try:
            module = importlib.import_module(module_path)
            backend_class = getattr(module, class_name)
            if not issubclass(backend_class, HiCacheStorage):
                raise TypeError(f"Backend class {class_name} must inherit from HiCacheStorage")
            return backend_class
        except ImportError as e:
            raise ImportError(f"Failed to import backend '{backend_name}' from '{module_path}': {e}") from e
        except AttributeError as e:
            raise AttributeError(f"Class '{class_name}' not found in module '{module_path}': {e}") from e

    @classmethod
    def register_backend(cls, name: str, module_path: str, class_name: str) -> None:
        def loader():
            return cls._load_backend_class(module_path, class_name, name)

        cls._registry[name] = {"loader": loader, "module_path": module_path, "class_name": class_name}

    @classmethod
    def create_backend(cls, backend_name: str, storage_config: HiCacheStorageConfig, mem_pool_host: Any,
                       **kwargs) -> HiCacheStorage:
        if backend_name in cls._registry:
            raise ValueError("the stand-in registers no built-in backend")
        if backend_name == "dynamic" and storage_config.extra_config is not None:
            return cls._create_dynamic_backend(storage_config.extra_config, storage_config, mem_pool_host,
                                               **kwargs)
        raise ValueError(f"Unknown storage backend '{backend_name}'. "
                         f"Registered backends: {list(cls._registry.keys())}. ")

    @classmethod
    def _create_dynamic_backend(cls, backend_config: Dict[str, Any], storage_config: HiCacheStorageConfig,
                                mem_pool_host: Any, **kwargs) -> HiCacheStorage:
        for field in ["backend_name", "module_path", "class_name"]:
            if field not in backend_config:
                raise ValueError(f"Missing required field '{field}' in backend config for 'dynamic' backend")
        backend_name = backend_config["backend_name"]
        module_path = backend_config["module_path"]
        class_name = backend_config["class_name"]
        try:
            backend_class = cls._load_backend_class(module_path, class_name, backend_name)
            logger.info(f"Creating dynamic storage backend '{backend_name}' ({module_path}.{class_name})")
            return backend_class(storage_config, kwargs)
        except Exception as e:
            logger.error(f"Failed to create dynamic storage backend '{backend_name}': {e}")
            raise
