"""Mirrors vllm/config/ (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
VllmConfig (config/vllm.py) and the sub-configs a connector reads —
ModelConfig (config/model.py: model, dtype, max_model_len), ParallelConfig
(config/parallel.py: tensor/pipeline/data/decode-context parallel sizes,
world_size = PP*TP), CacheConfig (config/cache.py: block_size, cache_dtype,
enable_prefix_caching, prefix_caching_hash_algo, prefix_match_unit,
mamba_cache_mode), SchedulerConfig (config/scheduler.py: token budget,
max_num_seqs, chunked prefill, long_prefill_token_threshold,
disable_hybrid_kv_cache_manager) — and KVTransferConfig
(config/kv_transfer.py). Plain dataclasses, no validation beyond vLLM's
defaults."""

from dataclasses import dataclass, field

from vllm.config.kv_transfer import KVTransferConfig


@dataclass
class ModelConfig:
    model: str = "Qwen/Qwen3-0.6B"
    dtype: str = "auto"
    max_model_len: int = 4096


@dataclass
class ParallelConfig:
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    decode_context_parallel_size: int = 1

    @property
    def world_size(self):
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    prefix_match_unit: int | None = None
    mamba_cache_mode: str = "none"
    num_gpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    disable_hybrid_kv_cache_manager: bool | None = None


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = None
    use_v2_model_runner: bool = False  # a property of the environment and model in vLLM 0.32


__all__ = ["VllmConfig", "ModelConfig", "ParallelConfig", "CacheConfig", "SchedulerConfig",
           "KVTransferConfig"]
