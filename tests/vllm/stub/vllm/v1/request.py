"""Mirrors vllm/v1/request.py (vllm-project/vllm @ 003df2961dd8830c317a61f9745ccd557da9fa06;
Request B:L59, RequestStatus B:L348) for what a connector reads:
request_id, prompt_token_ids, num_prompt_tokens, all_token_ids (read-only
view of prompt + output), output_token_ids, num_tokens, num_output_tokens,
num_computed_tokens, block_hashes (chained over hash_block_size-token
blocks, extended whenever tokens are appended), num_publishable_block_hashes
(0: only EAGLE prefix-cache hashing raises it), status, kv_transfer_params
(from sampling_params.extra_args), cache_salt, num_preemptions,
sampling_params, max_tokens, lora_request / mm_features (None / [])."""

import enum
import time


class ConstantList:
    """Read-only view of a list (vllm/v1/utils.py ConstantList)."""

    __slots__ = ("_x",)

    def __init__(self, x):
        self._x = x

    def __len__(self):
        return len(self._x)

    def __getitem__(self, i):
        return self._x[i]

    def __iter__(self):
        return iter(self._x)

    def __contains__(self, v):
        return v in self._x

    def index(self, *a):
        return self._x.index(*a)

    def copy(self):
        return list(self._x)

    def __eq__(self, other):
        return list(self._x) == list(other)

    def __repr__(self):
        return "ConstantList(%r)" % (self._x,)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after PREEMPTED is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self):
        return self.name

    @staticmethod
    def is_finished(status):
        return status > RequestStatus.PREEMPTED


class Request:
    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params=None,
                 client_index=0, arrival_time=None, prompt_embeds=None, mm_features=None,
                 lora_request=None, cache_salt=None, priority=0, block_hasher=None):
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason = None
        self.kv_transfer_params = None
        if sampling_params is None:
            raise ValueError("sampling_params and pooling_params can't both be unset")
        self.max_tokens = sampling_params.max_tokens
        extra = sampling_params.extra_args
        if extra is not None:
            self.kv_transfer_params = extra.get("kv_transfer_params")
            self.kv_cache_report_mode = extra.get("kv_cache_report_mode", "incremental")
        else:
            self.kv_cache_report_mode = "incremental"
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids = []
        self._all_token_ids = list(prompt_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.spec_token_ids = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.mm_features = mm_features or []
        self.num_preemptions = 0
        self.is_prefill_chunk = False
        self.skip_reading_prefix_cache = False
        self.block_hashes = []
        self.num_publishable_block_hashes = 0
        self._block_hasher = block_hasher
        self.update_block_hashes()

    def append_output_token_ids(self, token_ids):
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self):
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self):
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self):
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self):
        return len(self._output_token_ids)

    def is_finished(self):
        return RequestStatus.is_finished(self.status)

    def __repr__(self):
        return "Request(%s, %s, computed=%d/%d)" % (self.request_id, self.status, self.num_computed_tokens,
                                                    self.num_tokens)
