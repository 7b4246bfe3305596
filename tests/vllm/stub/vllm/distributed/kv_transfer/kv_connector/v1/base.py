"""Mirrors vllm/distributed/kv_transfer/kv_connector/v1/base.py
(the vllm release named in tests/vllm/vllm_api.txt, which
tests/vllm_engine/dump_api.py writes from the installed package and
tests/vllm_engine/test_units.py compares with it).

Same class names, method names, parameter names and default behaviour as
vLLM: SupportsHMA (abstract request_finished_all_groups), supports_hma,
KVConnectorRole, KVConnectorHandshakeMetadata, KVConnectorMetadata,
KVConnectorWorkerMetadata (abstract aggregate), KVConnectorBase_V1 with its
seven abstract methods (start_load_kv, wait_for_layer_load, save_kv_layer,
wait_for_save, get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta) and the no-op / None / False defaults of the rest.
"""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class KVConnectorTransferResults:
    """Asynchronous transfer completions from one worker snapshot; failed
    receives also appear in finished_recving."""
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


class SupportsHMA(ABC):
    """Marks a connector usable with the hybrid KV-cache manager (several
    KV-cache groups). The factory refuses other connectors while HMA is on."""

    @abstractmethod
    def request_finished_all_groups(self, request, block_ids):
        """Once per finished request, before its blocks (one list per
        group) are freed. Returns (delay_free, kv_transfer_params): True
        keeps the blocks until the id comes back in finished_sending."""
        raise NotImplementedError


def supports_hma(connector):
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0   # in the scheduler (EngineCore) process
    WORKER = 1      # in each worker process


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    """Out-of-band handshake data between P/D workers (serializable)."""


class KVConnectorMetadata(ABC):  # noqa: B024
    """What the scheduler-side connector sends the workers each step (pickled
    with the SchedulerOutput)."""


class KVConnectorWorkerMetadata(ABC):
    """What each worker-side connector sends back each step; the outputs of
    all workers are folded with ``aggregate`` before the scheduler sees them."""

    @abstractmethod
    def aggregate(self, other):
        pass


class KVConnectorBase_V1(ABC):
    """vLLM's V1 KV connector interface."""

    @property
    def supports_divergent_local_hybrid_hits(self):
        return False

    @property
    def requires_kv_delivery(self):
        return self._kv_transfer_config.is_kv_producer

    def __init__(self, vllm_config, role, kv_cache_config):
        logger.debug("Initializing KVConnectorBase_V1 (stand-in)")
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self):
        return self._role

    # ---- worker side ----

    def get_mem_pool_context(self):
        return None

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self):
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        return

    def set_host_xfer_buffer_ops(self, copy_operation):
        return

    def finish_forward(self):
        return

    def reset_capture_state(self):
        return

    def handle_preemptions(self, kv_connector_metadata):
        return

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs):
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name):
        pass

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    @abstractmethod
    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        return None, None

    def get_transfer_results(self, finished_req_ids):
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(finished_sending or ()),
                                          finished_recving=set(finished_recving or ()))

    def get_block_ids_with_load_errors(self):
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self):
        return None

    def get_kv_connector_kv_cache_events(self):
        return None

    def get_handshake_metadata(self):
        return None

    def build_connector_worker_meta(self):
        return None

    # ---- scheduler side ----

    def bind_kv_cache_manager(self, kv_cache_manager):
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool):
        return

    def get_loaded_kv_cache_group_ids(self, request):
        return self._kv_cache_config.prefix_cacheable_group_ids

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        pass

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return {} if num_external_tokens == 0 else {"external": num_external_tokens}

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output):
        pass

    def on_new_request(self, request):
        return

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request, block_ids):
        return False, None

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
        return

    def take_events(self):
        return ()

    def has_pending_block_frees(self):
        return False

    def has_pending_push_work(self):
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout is for connector classes, not the base class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        return False

    def get_finished_count(self):
        return None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None

    def set_xfer_handshake_metadata(self, metadata):
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError("%s: handshake metadata for a pipeline stage other than 0, and no "
                             "pipeline-parallel support" % type(self).__name__)
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return None

    def reset_cache(self):
        logger.debug("Connector cache reset requested, but %s does not implement reset_cache().",
                     type(self).__name__)
        return None
