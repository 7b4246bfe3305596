"""Mirrors the storage half of HiCacheController in
python/sglang/srt/managers/cache_controller.py (sgl-project/sglang @
001067fffe33427bee0ed2f007fb7551a1d76b44): how the L3 backend is created and
called, in SGLang's order.

- attach_storage_backend: builds HiCacheStorageConfig (_generate_storage_config),
  sets backup_skip (MLA: only TP rank 0 backs up), creates the backend with
  StorageBackendFactory.create_backend(backend, config, host_pool), calls
  register_mem_pool_host(host_pool), and picks the zero-copy page functions
  (batch_get_v1 / batch_set_v1) for "dynamic" only when extra_config has a
  true "interface_v1";
- the prefetch thread body (_storage_hit_query: batch_exists over batches of
  STORAGE_BATCH_SIZE page hashes, stopping at the first short batch; then an
  all_reduce MIN of the hit tokens over the TP group), the I/O thread body
  (_page_transfer: per batch _page_transfer_kv_batch, i.e. batch_get_v1
  counting the leading successes and, for a hybrid operation's KV-derived
  pools (indices_from_pool == KV), batch_get_v2 of the same pages, the minimum
  of the hits; one PrefetchAck per batch reduced with MIN over the TP group)
  and the backup
  thread body (_page_backup: batch_set_v1 per batch, stopping at the first
  failed batch; skipped when backup_skip).

SGLang runs those bodies on three threads fed by queues; here they are called
in the same order by the test's rank processes (run_prefetch, run_backup).
The device side (layer counters, load/write queues, rate limiting, buffer
mode, router hints, KV-derived sidecar pools) is left out; the parallel state
comes as parameters instead of sglang.srt.runtime_context.
"""

import logging

import torch

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)

logger = logging.getLogger(__name__)


class StorageOperation:
    counter = 0

    def __init__(self, host_indices, token_ids, last_hash=None, hash_value=None, prefix_keys=None):
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.completed_tokens = 0
        self.hash_value = hash_value if hash_value is not None else []
        self.prefix_keys = prefix_keys
        self.all_hash_values = None
        self.id = StorageOperation.counter
        StorageOperation.counter += 1


class PrefetchOperation(StorageOperation):
    def __init__(self, request_id, token_ids, last_hash=None, prefix_keys=None):
        self.request_id = request_id
        self._terminated_flag = False
        self.storage_hit_count = 0
        super().__init__(None, token_ids, last_hash, prefix_keys=prefix_keys)

    def mark_terminate(self):
        self._terminated_flag = True

    def is_terminated(self):
        return self._terminated_flag


class HiCacheController:
    def __init__(self, mem_pool_host, page_size, tp_group=None, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                 is_mla_model=False, storage_backend=None, model_name=None, storage_backend_extra_config=None):
        self.mem_pool_host = mem_pool_host
        self.storage_host_pool = mem_pool_host
        self.page_size = page_size
        self.tp_group = tp_group
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        self.is_mla_model = is_mla_model
        self.enable_storage = False
        self.storage_backend = None
        if storage_backend is not None:
            self.attach_storage_backend(storage_backend, model_name=model_name,
                                        storage_backend_extra_config=storage_backend_extra_config)

    def _all_reduce_min(self, value):
        t = torch.tensor(value, dtype=torch.int)
        if self.tp_group is not None and torch.distributed.get_world_size(group=self.tp_group) > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return t.item()

    def attach_storage_backend(self, storage_backend, prefetch_threshold=256, model_name=None,
                               storage_backend_extra_config=None):
        if self.enable_storage:
            raise RuntimeError("Storage backend already attached.")
        self.storage_backend_type = storage_backend
        from sglang.srt.mem_cache.utils import get_hash_str
        self.get_hash_str = get_hash_str
        self.storage_config = self._generate_storage_config(model_name, storage_backend_extra_config)
        # for MLA models, only one rank needs to backup the KV cache
        self.backup_skip = self.storage_config.is_mla_model and self.storage_config.tp_rank != 0
        from sglang.srt.mem_cache.storage import StorageBackendFactory
        self.storage_backend = StorageBackendFactory.create_backend(storage_backend, self.storage_config,
                                                                    self.storage_host_pool)
        self.storage_backend.register_mem_pool_host(self.storage_host_pool)
        self.enable_storage = True
        self.prefetch_threshold = max(prefetch_threshold, self.page_size)
        self.page_get_func = self._generic_page_get
        self.page_set_func = self._generic_page_set
        if self.storage_backend_type == "dynamic" and bool(self.storage_config.extra_config.get("interface_v1", 0)):
            self.page_get_func = self._page_get_zero_copy
            self.page_set_func = self._page_set_zero_copy

    def _generate_storage_config(self, model_name=None, storage_backend_extra_config=None):
        if storage_backend_extra_config is None:
            storage_backend_extra_config = {}
        tp_lcm_size = storage_backend_extra_config.pop("tp_lcm_size", None)
        return HiCacheStorageConfig(
            tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
            attn_cp_rank=0, attn_cp_size=1, is_mla_model=self.is_mla_model, enable_storage_metrics=False,
            is_page_first_layout=self.mem_pool_host.layout == "page_first", model_name=model_name,
            dp_rank=0, dp_size=1, tp_lcm_size=tp_lcm_size, should_split_heads=False,
            extra_config=storage_backend_extra_config)

    # ---- prefetch (prefetch_thread_func + prefetch_io_aux_func) ----

    def prefetch(self, request_id, new_input_tokens, last_hash=None, prefix_keys=None):
        return PrefetchOperation(request_id, new_input_tokens, last_hash, prefix_keys)

    def _storage_hit_query(self, operation):
        last_hash = operation.last_hash
        tokens_to_fetch = operation.token_ids
        prefix_keys = operation.prefix_keys.copy() if operation.prefix_keys else None
        storage_query_count = 0
        hash_value = []
        page_hashes = self.get_hash_str(tokens_to_fetch, last_hash, page_size=self.page_size)
        operation.all_hash_values = page_hashes
        for start in range(0, len(page_hashes), STORAGE_BATCH_SIZE):
            batch_hashes = page_hashes[start:start + STORAGE_BATCH_SIZE]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys, extra_info=None)
            hit_page_num = self.storage_backend.batch_exists(batch_hashes, extra_info)
            hash_value.extend(batch_hashes[:hit_page_num])
            storage_query_count += hit_page_num * self.page_size
            if hit_page_num < len(batch_hashes):
                break
            if prefix_keys and len(prefix_keys) > 0:
                prefix_keys += batch_hashes
        return hash_value, storage_query_count

    def run_prefetch_query(self, operation):
        """The prefetch thread's body for one operation (hit count reduced
        with MIN over the TP group)."""
        if operation.is_terminated():
            hash_value, storage_hit_count = [], 0
        else:
            hash_value, storage_hit_count = self._storage_hit_query(operation)
        storage_hit_count = self._all_reduce_min(storage_hit_count)
        operation.hash_value = hash_value[: (storage_hit_count // self.page_size)]
        operation.storage_hit_count = storage_hit_count
        return operation

    def _page_get_zero_copy(self, operation, hash_values, host_indices, extra_info=None):
        results = self.storage_backend.batch_get_v1(hash_values, host_indices, extra_info)
        inc = 0
        for i in range(len(hash_values)):
            if not results[i]:
                logger.warning(f"Prefetch operation {operation.request_id} failed to retrieve page {hash_values[i]}.")
                break
            inc += 1
        return inc

    def _generic_page_get(self, operation, hash_values, host_indices, extra_info=None):
        raise NotImplementedError("the stand-in implements the zero-copy path only")

    def _page_transfer(self, operation):
        """prefetch_io_aux_func's body: returns the acked (MIN-reduced)
        completed tokens after each batch, as SGLang's sync thread sees them."""
        prefix_keys = operation.prefix_keys
        kv_derived_transfers = [
            transfer
            for transfer in getattr(operation, "pool_transfers", None) or []
            if transfer.indices_from_pool == PoolName.KV
        ]
        all_success = True
        completed_pages = 0
        acks = []
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            if all_success and operation.is_terminated():
                all_success = False
            if all_success:
                batch_hashes = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
                batch_host_indices = operation.host_indices[
                    i * self.page_size:(i + len(batch_hashes)) * self.page_size]
                extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys, extra_info=None)
                hit_pages = self._page_transfer_kv_batch(operation, batch_hashes, batch_host_indices, extra_info,
                                                         kv_derived_transfers)
                if hit_pages != len(batch_hashes):
                    all_success = False
                if prefix_keys and len(prefix_keys) > 0:
                    prefix_keys += batch_hashes
                completed_pages += hit_pages
            # PrefetchAck(completed_tokens=...) reduced by prefetch_sync_thread_func
            acks.append(self._all_reduce_min(completed_pages * self.page_size))
        operation.completed_tokens = acks[-1] if acks else 0
        return completed_pages

    def _page_transfer_kv_batch(self, operation, batch_hashes, batch_host_indices, extra_info,
                                kv_derived_transfers):
        """Read a single batch from KV and KV-derived pools (e.g. indexer pool):
        the minimum of their hits."""
        kv_hits = self.page_get_func(operation, batch_hashes, batch_host_indices, extra_info)
        sidecar_hits = {}
        if len(kv_derived_transfers) > 0:
            current_kv_derived_transfers = [
                PoolTransfer(name=transfer.name, host_indices=batch_host_indices, keys=batch_hashes)
                for transfer in kv_derived_transfers
            ]
            sidecar_results = self.storage_backend.batch_get_v2(current_kv_derived_transfers)
            sidecar_hits = count_pool_hits(sidecar_results)
        return min([kv_hits, *sidecar_hits.values()])

    # ---- backup (backup_thread_func) ----

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None):
        return StorageOperation(host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys)

    def _generic_page_set(self, hash_values, host_indices, extra_info=None):
        raise NotImplementedError("the stand-in implements the zero-copy path only")

    def _page_set_zero_copy(self, hash_values, host_indices, extra_info=None):
        return all(self.storage_backend.batch_set_v1(hash_values, host_indices, extra_info))

    def _page_backup(self, operation):
        prefix_keys = operation.prefix_keys
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            batch_hashes = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
            batch_host_indices = operation.host_indices[i * self.page_size:(i + len(batch_hashes)) * self.page_size]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            success = self.page_set_func(batch_hashes, batch_host_indices, extra_info)
            if not success:
                logger.warning(f"Write page to storage: {len(batch_hashes)} pages failed.")
                break
            if prefix_keys and len(prefix_keys) > 0:
                prefix_keys += batch_hashes
            operation.completed_tokens += self.page_size * len(batch_hashes)

    def run_backup(self, operation):
        """The backup thread's body for one operation."""
        if not self.backup_skip:
            self._page_backup(operation)
        return operation
