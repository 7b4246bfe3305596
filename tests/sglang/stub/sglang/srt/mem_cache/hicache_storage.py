"""Mirrors python/sglang/srt/mem_cache/hicache_storage.py
(sgl-project/sglang @ 001067fffe33427bee0ed2f007fb7551a1d76b44; the public
API is listed in tests/sglang/sglang_api.txt).

Same class names, fields, method names, parameter names, abstract methods and
default behaviour: HiCacheStorageConfig, HiCacheStorageExtraInfo,
STORAGE_BATCH_SIZE, the hybrid v2 interface's types (PoolName with every
member, PoolHitPolicy, PoolTransfer, SidecarPoolSpec, PoolTransferResult with
empty / update_kv_hit_pages / update_extra_pool_hit_pages, count_pool_hits),
and HiCacheStorage with its five
abstract methods (get, batch_get, set, batch_set, exists), the v1 zero-copy
calls (which raise NotImplementedError unless overridden, as at that commit),
the v2 calls (register_mem_host_pool_v2 records the pool in registered_pools;
batch_exists_v2 / batch_get_v2 / batch_set_v2 raise NotImplementedError),
batch_exists built on exists, clear and get_stats. PrefetchTimeoutConfig, the
file backend (HiCacheFile) and MetadataCache are left out; the tensor type
hints are Any (the stand-in imports no torch here).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, List, Optional

logger = logging.getLogger(__name__)

# Max pages per batched storage IO call.
STORAGE_BATCH_SIZE = 128


@dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class PoolName(str, Enum):
    """Well-known pool names used as PoolTransfer/PoolEntry identifiers."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"
    DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
    DEEPSEEK_V4_C128 = "deepseek_v4_c128"
    DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
    DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
    DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"

    # Draft KV pool
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, Enum):
    """Hit policy for batch_exists_v2 per-pool prefix matching.

    ALL_PAGES      : every page in [0, kv_hit) must exist (e.g. DSA).
    TRAILING_PAGES : only the last N pages must exist (e.g. Mamba/SWA states).
    """

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass
class PoolTransfer:
    """Unified per-pool transfer descriptor for batch v2 interface.

    device<->host path : host_indices + device_indices
    host<->storage path: host_indices + keys
    nodes_to_load      : evicted nodes this transfer covers
    """

    name: PoolName
    host_indices: Optional[Any] = None
    device_indices: Optional[Any] = None
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Optional[PoolName] = None


@dataclass(frozen=True)
class SidecarPoolSpec:
    """Pool whose transfer indices are reused from one real source pool."""

    pool_name: PoolName
    indices_from_pool: PoolName
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES


@dataclass
class PoolTransferResult:
    """Tracks how many pages were successfully processed per pool."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict

    @classmethod
    def empty(cls) -> "PoolTransferResult":
        return cls(0, {})

    def update_kv_hit_pages(self, kv_hit_pages: int) -> None:
        """Accumulate kv_hit_pages across batches (max = last successful batch)."""
        self.kv_hit_pages = max(self.kv_hit_pages, kv_hit_pages)

    def update_extra_pool_hit_pages(self, results: dict) -> None:
        """Record actual load/write success counts per extra pool."""
        self.extra_pool_hit_pages.update(results)


def count_pool_hits(results: dict) -> dict:
    return {
        name: (rs.index(False) if False in rs else len(rs))
        for name, rs in results.items()
    }


class HiCacheStorage(ABC):
    """
    HiCacheStorage is a class that provides a generic key-value interface for storing and retrieving KV cache.
    It abstracts the underlying storage mechanism, allowing different implementations to be used.
    """

    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        raise NotImplementedError()

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        raise NotImplementedError()

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        raise NotImplementedError()

    def batch_get_v1(self, keys: List[str], host_indices,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Retrieve values for multiple keys. Returns a list of booleans
        indicating success for each key."""
        raise NotImplementedError()

    def batch_set_v1(self, keys: List[str], host_indices,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store multiple key-value pairs. Returns a list of booleans
        indicating success for each key."""
        raise NotImplementedError()

    @abstractmethod
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        pass

    @abstractmethod
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        pass

    @abstractmethod
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        pass

    @abstractmethod
    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        pass

    @abstractmethod
    def exists(self, key: str) -> bool:
        pass

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Return the number of consecutive existing keys from the start."""
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None
