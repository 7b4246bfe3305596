"""Mirrors vllm/v1/core/sched/output.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
NewRequestData (B:L35; block_ids = the full table of every group, null
block 0 included), CachedRequestData (B:L116; new_block_ids appended to the
worker's table, or replacing it for resumed_req_ids) and SchedulerOutput
(B:L193), with vLLM's field names and defaults."""

from dataclasses import dataclass
from typing import Any


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    prefill_token_ids: list[int] | None = None

    @classmethod
    def from_request(cls, request, block_ids, prefill_token_ids=None):
        return cls(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   mm_features=request.mm_features, sampling_params=request.sampling_params,
                   pooling_params=request.pooling_params, block_ids=block_ids,
                   num_computed_tokens=request.num_computed_tokens, lora_request=request.lora_request,
                   prompt_embeds=request.prompt_embeds, prefill_token_ids=prefill_token_ids)


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self):
        return len(self.req_ids)

    def is_context_phase(self, req_id):
        n = dict(zip(self.req_ids, self.num_output_tokens)).get(req_id)
        return n is not None and n == 0

    @classmethod
    def make_empty(cls):
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    scheduled_encoder_input_stats: Any = None
    preempted_req_ids: set[str] | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[str, int] | None = None
    kv_connector_metadata: Any = None
    ec_connector_metadata: Any = None
    ec_manager_metadata: Any = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list | None = None
    partial_tail_offloads: dict | None = None
    num_spec_tokens_to_schedule: int = 0

    @classmethod
    def make_empty(cls):
        return cls(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                   num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                   scheduled_encoder_inputs={}, num_common_prefix_blocks=[], finished_req_ids=set(),
                   free_encoder_mm_hashes=[])
