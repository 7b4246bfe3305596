"""Mirrors the storage half of HybridCacheController in
python/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py
(sgl-project/sglang @ 00343773d3293d382f0b39101f36b656d30ad2f0, the copy read,
none at 001067ff being available. Its calls into the storage backend
match the v2 interface of hicache_storage.py at
001067fffe33427bee0ed2f007fb7551a1d76b44, and the base controller parts it
uses (_page_transfer_kv_batch, _page_backup, _generate_storage_config) are
those of managers/cache_controller.py at that commit): how SGLang
drives a backend for hybrid models (Mamba/GDN states, SWA, DSA indexer).

- construction: the host pool is a HostPoolGroup; storage_host_pool is the
  anchor entry's pool; attach_storage_backend runs the base attach (backend
  created with, and register_mem_pool_host called on, the anchor pool) and
  then register_mem_host_pool_v2(entry.host_pool, entry.name) for every
  entry, the anchor included;
- prefetch / write_storage carry ``extra_pools`` (PoolTransfer list) as the
  operation's pool_transfers;
- _storage_hit_query: all page hashes at once, batch_exists_v2(hashes,
  pool_transfers, extra_info) when the operation has pool transfers, else
  batch_exists; the KV hit is kv_hit_pages;
- _page_transfer: the base transfer (KV pages and KV-derived pools batch by
  batch), then _page_transfer_sidecar: only if KV completed every hit page,
  _sync_trailing_keys (a trailing_pages pool's keys become the last N hit
  hashes, its host indices are cut to N pages), the non-KV-derived pools'
  indices resolved, one batch_get_v2, count_pool_hits; one PrefetchAck with
  pool_hits, reduced with MIN over the TP group in PoolName order;
- _page_backup (run by every TP rank: backup_thread_func is overridden):
  the transfers should_backup keeps (all, or for a rank-replicated model on
  TP ranks other than 0 only the TP-sharded Mamba pool), KV-derived pools'
  indices and keys resolved from the operation, one batch_set_v2, then the
  base KV backup unless backup_skip.

Threads, queues, device transfers (write/load, L2 transfers, release queues
beyond recording what is released) are left out, as in the base stand-in.
"""

import logging

import torch

from sglang.srt.managers.cache_controller import HiCacheController as BaseHiCacheController
from sglang.srt.managers.cache_controller import StorageOperation as BaseStorageOperation
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

logger = logging.getLogger(__name__)


class StorageOperation(BaseStorageOperation):
    def __init__(self, host_indices, token_ids, last_hash=None, hash_value=None, prefix_keys=None,
                 pool_transfers=None):
        super().__init__(host_indices, token_ids, last_hash, hash_value, prefix_keys)
        self.pool_transfers = pool_transfers
        self.pool_storage_result = PoolTransferResult.empty()


class PrefetchOperation(StorageOperation):
    def __init__(self, request_id, token_ids, last_hash=None, prefix_keys=None, pool_transfers=None):
        self.request_id = request_id
        self._terminated_flag = False
        self.storage_hit_count = 0
        super().__init__(None, token_ids, last_hash, prefix_keys=prefix_keys, pool_transfers=pool_transfers)
        self.pool_transfers_done = not bool(pool_transfers)
        self.pool_hits = None

    def mark_terminate(self):
        self._terminated_flag = True

    def is_terminated(self):
        return self._terminated_flag


class HybridCacheController(BaseHiCacheController):
    def __init__(self, mem_pool_host, page_size, tp_group=None, *, storage_backend=None, model_name=None,
                 storage_backend_extra_config=None, **kw):
        startup_storage_backend = storage_backend
        self.released = []  # what append_host_mem_release queued (pool name, indices)
        super().__init__(mem_pool_host, page_size, tp_group, storage_backend=None, model_name=model_name,
                         storage_backend_extra_config=storage_backend_extra_config, **kw)
        self.storage_host_pool = mem_pool_host.anchor_entry.host_pool
        if startup_storage_backend is not None:
            self.attach_storage_backend(startup_storage_backend, model_name=model_name,
                                        storage_backend_extra_config=storage_backend_extra_config,
                                        host_pools=getattr(mem_pool_host, "entries", None))

    def attach_storage_backend(self, storage_backend, prefetch_threshold=256, model_name=None,
                               storage_backend_extra_config=None, host_pools=None):
        super().attach_storage_backend(storage_backend, prefetch_threshold=prefetch_threshold,
                                       model_name=model_name,
                                       storage_backend_extra_config=storage_backend_extra_config)
        for entry in host_pools or []:
            self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)

    def append_host_mem_release(self, host_indices=None, extra_pools=None):
        for transfer in extra_pools or []:
            if transfer.host_indices is not None and transfer.host_indices.numel():
                self.released.append((transfer.name, transfer.host_indices))

    def prefetch(self, request_id, new_input_tokens, last_hash=None, prefix_keys=None, extra_pools=None):
        return PrefetchOperation(request_id, new_input_tokens, last_hash, prefix_keys=prefix_keys,
                                 pool_transfers=extra_pools)

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None, extra_pools=None):
        return StorageOperation(host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys,
                                pool_transfers=extra_pools)

    def _storage_hit_query(self, operation):
        hash_value = self.get_hash_str(operation.token_ids, operation.last_hash, page_size=self.page_size)
        operation.all_hash_values = hash_value
        extra_info = HiCacheStorageExtraInfo(
            prefix_keys=operation.prefix_keys.copy() if operation.prefix_keys else None)
        if operation.pool_transfers:
            hit_result = self.storage_backend.batch_exists_v2(hash_value, operation.pool_transfers, extra_info)
        else:
            kv_hit_count = self.storage_backend.batch_exists(hash_value, extra_info)
            hit_result = PoolTransferResult(kv_hit_pages=kv_hit_count, extra_pool_hit_pages={})
        kv_hit_pages = hit_result.kv_hit_pages
        operation.pool_storage_result.update_kv_hit_pages(kv_hit_pages)
        return hash_value[:kv_hit_pages], kv_hit_pages * self.page_size

    def _page_transfer(self, operation):
        # KV pools and KV-derived pools first — determines actual completed page count
        kv_completed_pages = super()._page_transfer(operation)
        # Read non-KV derived sidecar pool, e.g. SWA, Mamba.
        self._page_transfer_sidecar(operation, kv_completed_pages)
        return kv_completed_pages

    def _page_transfer_sidecar(self, operation, kv_completed_pages):
        if operation.pool_transfers is None:
            return
        pool_hits = {}
        if not operation.is_terminated() and kv_completed_pages == len(operation.hash_value):
            transfers_nonkv = [t for t in operation.pool_transfers if t.indices_from_pool != PoolName.KV]
            self._sync_trailing_keys(transfers_nonkv, operation.hash_value, kv_completed_pages)
            self._resolve_sidecar_nonkv_derived_pool_transfers(operation)
            results = self.storage_backend.batch_get_v2(transfers_nonkv)
            pool_hits = count_pool_hits(results)
        # PrefetchAck(pool_hits=...) reduced by prefetch_sync_thread_func
        operation.pool_hits = self._reduce_pool_hits(pool_hits)

    def _reduce_pool_hits(self, pool_hits):
        # "for ... in PoolName" ensures the same order across all ranks.
        packed = torch.tensor([pool_hits.get(pool.value, pool_hits.get(pool, 0)) for pool in PoolName],
                              dtype=torch.int)
        if self.tp_group is not None and torch.distributed.get_world_size(group=self.tp_group) > 1:
            torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return {pool.value: packed[i].item() for i, pool in enumerate(PoolName)}

    def _page_backup(self, operation):
        # MLA KV is replicated across TP ranks and should still be written only
        # by TP0. Rank-sharded sidecars still need every TP rank.
        backup_transfers = [t for t in operation.pool_transfers or [] if self.should_backup(t)]
        results = {}
        if backup_transfers:
            self._resolve_sidecar_kv_derived_pool_transfers(operation)
            self._resolve_sidecar_nonkv_derived_pool_transfers(operation)
            results = self.storage_backend.batch_set_v2(backup_transfers)
            operation.pool_storage_result.update_extra_pool_hit_pages(count_pool_hits(results))
        if not self.backup_skip:
            super()._page_backup(operation)
        else:
            sidecar_ok = bool(backup_transfers)
            if sidecar_ok:
                for transfer in backup_transfers:
                    result = results.get(transfer.name)
                    if result is None:
                        result = results.get(transfer.name.value)
                    expected = len(transfer.keys or [])
                    if expected == 0 and transfer.host_indices is not None:
                        expected = int(transfer.host_indices.numel())
                    if (not isinstance(result, (list, tuple)) or len(result) != expected
                            or not all(bool(ok) for ok in result)):
                        sidecar_ok = False
                        break
            operation.completed_tokens = len(operation.hash_value) * self.page_size if sidecar_ok else 0

    def should_backup(self, transfer):
        if not self.backup_skip:
            return True
        # Kimi-K3 Mamba/KDA state is TP-sharded even when the primary MLA KV
        # pool is replicated.
        if transfer.name == PoolName.MAMBA:
            return True
        if self.storage_backend_type == "mooncake" and transfer.name in (PoolName.DRAFT, PoolName.DRAFT_SWA):
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            return entry is not None and isinstance(entry.host_pool, MHATokenToKVPoolHost)
        return False

    def run_backup(self, operation):
        """backup_thread_func's body: every rank runs _page_backup."""
        self._page_backup(operation)
        return operation

    def _resolve_sidecar_kv_derived_pool_transfers(self, operation):
        for transfer in operation.pool_transfers:
            if transfer.indices_from_pool == PoolName.KV:
                transfer.host_indices = operation.host_indices
                if transfer.keys is None:
                    transfer.keys = operation.hash_value

    def _resolve_sidecar_nonkv_derived_pool_transfers(self, operation):
        for transfer in operation.pool_transfers:
            if transfer.indices_from_pool is None or transfer.indices_from_pool == PoolName.KV:
                continue
            source = next((t for t in operation.pool_transfers
                           if t.indices_from_pool is None and t.name == transfer.indices_from_pool), None)
            if source is None:
                raise AssertionError("Storage sidecar derived pool source missing: "
                                     f"{transfer.name} from {transfer.indices_from_pool}.")
            transfer.host_indices = source.host_indices
            if transfer.keys is None:
                transfer.keys = source.keys

    def _sync_trailing_keys(self, pool_transfers, all_hashes, kv_hit_pages):
        """Re-align trailing-page sidecar keys after KV hit truncation."""
        for transfer in pool_transfers:
            if transfer.hit_policy != PoolHitPolicy.TRAILING_PAGES:
                continue
            trailing_n = len(transfer.keys) if transfer.keys else 1
            transfer.keys = all_hashes[max(0, kv_hit_pages - trailing_n): kv_hit_pages]
            if transfer.host_indices is None:
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            pool_page_size = entry.host_pool.page_size if entry is not None else self.page_size
            needed = len(transfer.keys) * pool_page_size
            if transfer.host_indices.numel() > needed:
                self.append_host_mem_release(extra_pools=[
                    PoolTransfer(name=transfer.name, host_indices=transfer.host_indices[needed:])])
                transfer.host_indices = transfer.host_indices[:needed]
