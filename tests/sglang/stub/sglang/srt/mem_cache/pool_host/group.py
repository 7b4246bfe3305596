"""Mirrors python/sglang/srt/mem_cache/pool_host/group.py
(sgl-project/sglang @ 0142dde6f8f9ca74d5572c9572da056ab912152e, the copy
read, none at 001067ff being available; it is later than 001067ff: it
imports merge_source_transfers, which hicache_storage.py at 001067ff lacks;
the parts mirrored are those the storage path touches): PoolEntry
(a named host pool with its device pool and layer mapper, one of them the
primary index anchor) and HostPoolGroup, the allocation facade of a hybrid
model's host pools (entries, entry_map, anchor_entry; layout, page_size,
device and size of the anchor; alloc / free / available_size per pool;
kv_buffer of the anchor). The HybridCacheController hands
``anchor_entry.host_pool`` to register_mem_pool_host and every entry to
register_mem_host_pool_v2. The transfer-capability flags, layout leases,
host-receive buffer infos and transfer resolution are left out.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class PoolEntry:
    name: Any
    host_pool: Any
    device_pool: Any
    layer_mapper: Optional[Callable[[int], Optional[int]]]
    is_primary_index_anchor: bool = False
    host_evict_fn: Optional[Callable[[int], Any]] = None
    device_evict_fn: Optional[Callable[[int], Any]] = None
    device_alloc_fn: Optional[Callable[[int], Any]] = None
    device_free_fn: Optional[Callable[[Any], Any]] = None
    packed_draft_device_pools: tuple = ()


class HostPoolGroup:
    """Allocation facade for an anchor host pool and its side pools."""

    def __init__(self, entries):
        if not entries:
            raise ValueError("HostPoolGroup requires at least one pool entry.")
        if len({entry.name for entry in entries}) != len(entries):
            raise ValueError("HostPoolGroup pool names must be unique.")
        anchors = [entry for entry in entries if entry.is_primary_index_anchor]
        if len(anchors) > 1:
            raise ValueError("HostPoolGroup requires at most one anchor pool.")
        self.entries = list(entries)
        self.entry_map = {entry.name: entry for entry in entries}
        self.anchor_entry = anchors[0] if anchors else entries[0]
        self.layout = self.anchor_entry.host_pool.layout
        self.page_size = self.anchor_entry.host_pool.page_size
        self.device = self.anchor_entry.host_pool.device
        self.size = self.anchor_entry.host_pool.size

    def add_entry(self, entry):
        if entry.name in self.entry_map:
            raise ValueError(f"Host pool {entry.name} is already registered.")
        if entry.is_primary_index_anchor:
            raise ValueError("Cannot replace the anchor of an existing HostPoolGroup.")
        self.entries.append(entry)
        self.entry_map[entry.name] = entry

    def get_entry(self, name=None):
        return self.anchor_entry if name is None else self.entry_map[name]

    def get_pool(self, name):
        return self.get_entry(name).host_pool

    def alloc(self, need_size, *, pool=None, reclaim=None):
        """Allocate from one pool, optionally reclaiming once before retrying."""
        host_pool = self.get_entry(pool).host_pool
        indices = host_pool.alloc(need_size)
        if indices is None and reclaim is not None:
            reclaim(need_size)
            indices = host_pool.alloc(need_size)
        return indices

    def free(self, indices, *, pool=None):
        return self.get_entry(pool).host_pool.free(indices)

    @property
    def kv_buffer(self):
        return self.anchor_entry.host_pool.kv_buffer

    @property
    def size_per_token(self):
        return self.anchor_entry.host_pool.size_per_token

    def clear(self):
        for entry in self.entries:
            entry.host_pool.clear()

    def available_size(self, pool=None):
        return self.get_entry(pool).host_pool.available_size()
