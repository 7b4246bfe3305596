"""KvsideConnector: vLLM's KV connector (KVConnectorBase_V1 + SupportsHMA)
for a kvside server beside the engine. See docs/vllm.md.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvsideConnector",
      "kv_connector_module_path":"kvside.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"broker_dir":"/run/kvside","chunk_tokens":256}}'

vLLM builds one instance with role SCHEDULER in its EngineCore process
(scheduler.py: lookups, plans) and one with role WORKER per TP rank
(worker.py: registration, jobs); this class only routes vLLM's calls to the
half its role has, and calls of the other role are no-ops.
"""

import logging
import os
from math import gcd
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .config import ConnectorConfig, namespace_of
from .groups import group_infos
from .meta import KvsideConnectorMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:  # vLLM's own types (mypy against the installed vLLM: tests/vllm_engine/test_units.py)
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvside.vllm")

__all__ = ["KvsideConnector", "KvsideConnectorMetadata", "KvsideConnectorStats"]


class KvsideConnectorStats(KVConnectorStats):
    """Counters of one interval; summed over workers and the scheduler."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, Any]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _tp_rank_world(vllm_config):
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # the scheduler process has no TP group
        return 0, vllm_config.parallel_config.tensor_parallel_size


class KvsideConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        if kv_cache_config is None:
            raise ValueError("kvside: KvsideConnector needs the kv_cache_config")
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("kvside: KvsideConnector needs vLLM's kv_transfer_config")
        pc = vllm_config.parallel_config
        _check_parallelism(pc)
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self.groups = group_infos(kv_cache_config, self.cfg.chunk_tokens)
        sizes = [g.block_size for g in self.groups]
        hbs = self.cfg.hash_block_size or _hash_block_size(vllm_config, kv_cache_config, sizes)
        if self.cfg.chunk_tokens % hbs:
            raise ValueError("kvside: chunk_tokens %d is not a multiple of vLLM's hash block size %d"
                             % (self.cfg.chunk_tokens, hbs))
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        tp = pc.tensor_parallel_size
        self.namespace = namespace_of(self.cfg, _model_id(mc), _kv_dtype(mc, cc), tp, sizes,
                                      getattr(cc, "prefix_caching_hash_algo", "sha256"), _layout(cc, self.cfg))
        self.engine = "vllm-%s" % (ktc.engine_id or "0")
        load = self.cfg.load and getattr(ktc, "is_kv_consumer", True)
        store = self.cfg.store if getattr(ktc, "is_kv_producer", True) else "none"
        if store == "finished" and any(g.kind == "recurrent" for g in self.groups):
            raise ValueError("kvside: store 'finished' cannot keep Mamba states (vLLM frees them while "
                             "the request runs): use store 'eager' for hybrid models")
        self._sched: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, self.engine, self.namespace, tp, self.groups,
                                        len(kv_cache_config.kv_cache_groups), hbs, load, store)
        else:
            rank, world = _tp_rank_world(vllm_config)
            self._worker = WorkerSide(self.cfg, self.engine, self.namespace, rank, world, self.groups,
                                      kv_cache_config.num_blocks,
                                      [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups],
                                      saves_end_in_step=_v2_runner(vllm_config))
            kept = {g.index for g in self.groups}
            self._layer_group = {n: gi for gi, g in enumerate(kv_cache_config.kv_cache_groups)
                                 if gi in kept for n in g.layer_names}

    def _sched_side(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("kvside: a scheduler-side call on the worker's connector")
        return self._sched

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvside: a worker-side call on the scheduler's connector")
        return self._worker

    # ---- properties vLLM reads ----------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """One layout for every engine sharing a namespace (kv_layout, NHD by
        default): NHD and HND pages of one model have the same size, so the
        server could not tell them apart."""
        ktc = vllm_config.kv_transfer_config
        return ConnectorConfig.from_extra(ktc.kv_connector_extra_config if ktc else {}).kv_layout

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KvsideConnectorStats(data=dict(data or {}))

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker_side().register(kv_caches, self._layer_group)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and kv_connector_metadata is not None:
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv returns once a synchronous load is in place

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # one store job per step covers every layer (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """vLLM before 0.32 (get_transfer_results calls it otherwise)."""
        if self._worker is None:
            return None, None
        sending, recving, _ = self._worker.get_finished(self._connector_metadata, finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        """Finished stores and loads, and the loads that failed (also in
        finished_recving, as vLLM wants them)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.get_finished(self._connector_metadata, finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        side = self._worker or self._sched
        if side is None or not any(side.stats.values()):
            return None
        data = dict(side.stats)
        for k in side.stats:
            side.stats[k] = 0
        return KvsideConnectorStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.close()

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self._sched_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._sched_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched_side().update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._sched_side().request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._sched_side().request_finished(request, block_ids)


def _check_parallelism(pc: Any) -> None:
    """Pipeline and context parallelism are refused: a stage holds only some
    layers; with DCP/PCP each rank holds a share of every block's tokens."""
    if (getattr(pc, "pipeline_parallel_size", 1) or 1) != 1:
        raise ValueError("kvside: pipeline parallelism is not supported (pipeline_parallel_size %d)"
                         % pc.pipeline_parallel_size)
    for cp in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(pc, cp, 1) or 1) != 1:
            raise ValueError("kvside: context parallelism is not supported (%s %d): each rank "
                             "holds a share of every block's tokens" % (cp, getattr(pc, cp)))


def _v2_runner(vllm_config):
    """vLLM's V2 model runner (its default for dense models on GPUs) writes
    newly allocated blocks (zeroing, copy-on-write of a partial prefix hit)
    in update_requests, before any connector hook of the step: a block freed
    by a preemption and handed out again can be written while a store of the
    preempted request still reads it. So there every store ends within the
    step that issues it (wait_for_save waits)."""
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # a configuration vLLM itself would refuse later
        return False


def _model_id(mc):
    """The model as its KV bytes depend on it: its name or path, revision and
    quantization."""
    name = str(getattr(mc, "model", "?"))
    rev, quant = getattr(mc, "revision", None), getattr(mc, "quantization", None)
    return name + ("@%s" % rev if rev else "") + ("+%s" % quant if quant else "")


def _kv_dtype(mc, cc):
    """The cache's element type: cache_dtype, or the model's dtype when that
    is "auto" (float16 and bfloat16 pages have one size, so the server could
    not tell an engine of one from an engine of the other)."""
    d = str(getattr(cc, "cache_dtype", "auto"))
    if d == "auto":
        d = str(getattr(mc, "dtype", "auto")).replace("torch.", "")
    return d


def _layout(cc, cfg):
    """The layout the engine's caches have: vLLM's resolved one where it has
    one (cache_config.kv_cache_layout, vLLM >= 0.32: the attention backend may
    override a connector's wish, as the CPU backend does), else
    VLLM_KV_CACHE_LAYOUT, which vLLM puts over a connector's requirement, else
    the one the connector asks for."""
    return getattr(cc, "kv_cache_layout", None) or os.environ.get("VLLM_KV_CACHE_LAYOUT") or cfg.kv_layout


def _hash_block_size(vllm_config, kv_cache_config, sizes):
    """vLLM's hash block size: the one its EngineCore resolved
    (kv_cache_config.hash_block_size, vLLM >= 0.32), else the block size with
    one group, else prefix_match_unit or the gcd of the groups'
    (vllm/v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes)."""
    resolved = getattr(kv_cache_config, "hash_block_size", None)
    if resolved:
        return int(resolved)
    if len(sizes) == 1:
        return sizes[0]
    unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
    if unit:
        return int(unit)
    h = 0
    for s in sizes:
        h = gcd(h, s)
    return h
