"""A mini vLLM engine that drives any KV connector class in vLLM's call order.

One scheduler process (vLLM's EngineCore: Scheduler + KVCacheManager) and one
process per TP rank (vLLM's GPU worker with the V1 model runner), talking
over pipes, with a deterministic mock model whose bytes are checked exactly.
It runs on the stand-in ``vllm`` package (tests/vllm/stub) and mirrors
vllm-project/vllm at 003df2961dd8830c317a61f9745ccd557da9fa06 (scheduler.py,
kv_cache_manager.py, request.py, base.py) and e578de311c2416e66c6a8b9819586bb91de10f9d
(worker: gpu_model_runner.py, kv_connector_model_runner_mixin.py,
mamba_utils.py; single_type_kv_cache_manager.py; kv_connector/utils.py
KVOutputAggregator; factory.py). Line hints "B:L" are at the latter.

Scheduler (per step, as Scheduler.schedule / update_from_output):
- block pool: block 0 is the null block shared by every group; one block id
  belongs to one group at a time; per-request block tables per group; no
  local prefix cache (a connector hit is the only way to skip compute);
- RUNNING requests first (chunked prefill under a token budget; Mamba
  "align" chunks end on Mamba block boundaries, _mamba_block_aligned_split),
  then WAITING ones only if nothing was preempted in this step;
  ``get_num_new_matched_tokens(request, 0)`` for a request with no computed
  tokens: None -> retried in a later step; (n, True) -> WAITING_FOR_REMOTE_KVS
  with num_computed_tokens = n at once, promoted when every rank reported it
  in finished_recving; (n, False) -> scheduled now (at least one token must
  remain: vLLM asserts it, B:L914);
- allocate_slots (remove_skipped_blocks first: sliding-window blocks wholly
  outside the window and Mamba states two steps old become null and go back
  to the pool), ``update_state_after_alloc(request, all blocks of all
  groups, n)``, preemption when the pool runs dry (the last running request;
  all its blocks freed at once, num_computed_tokens = 0, reported in the next
  SchedulerOutput.preempted_req_ids) plus a test hook that preempts a given
  request at a given step, ``build_connector_meta`` before num_computed_tokens
  advance;
- admission as at the pinned commit: a waiting request only if its whole
  sequence fits (scheduler_reserve_full_isl, sliding-window groups capped),
  an asynchronous load only beside the blocks in-flight prefills still need;
- client aborts (Scheduler.finish_requests) from a test hook: a request
  still loading asynchronously keeps its blocks until its finished_recving;
- update_from_output: failed asynchronous loads (failed_recving, vLLM 0.32
  _handle_failed_recving: under "recompute" the request restarts from 0),
  KV-load errors (invalid_block_ids) under the "recompute" policy (truncate
  at the first bad block; with several KV-cache groups an EngineError, as
  vLLM 0.32 raises RuntimeError there), sampling, finishing
  (``request_finished_all_groups`` for SupportsHMA connectors, else
  ``request_finished``; True delays the free until every rank reported the id
  in finished_sending), ``update_connector_output``.
Workers (per step, as GPUModelRunner.execute_model): handle_preemptions(meta),
_update_states (zero new_block_ids_to_zero when the model has Mamba layers),
zero tokens -> kv_connector_no_forward (bind, start_load_kv, get_finished,
errors, stats, events, worker meta, clear; no wait_for_save), else the
Mamba "align" pre-copy BEFORE start_load_kv, then bind, start_load_kv(ctx),
per attention layer wait_for_layer_load / write KV / save_kv_layer (Mamba
layers get no per-layer calls), wait_for_save, get_finished(finished ids),
get_block_ids_with_load_errors, get_kv_connector_stats,
get_kv_connector_kv_cache_events, build_connector_worker_meta,
clear_connector_metadata. The outputs of all ranks are aggregated as
KVOutputAggregator does (an id counts once every rank reported it).

With ``runner="v2"`` (vLLM's default for dense models) the worker follows the
V2 model runner instead: handle_preemptions inside pre_forward (after
_update_states and the state pre-copy; also on the no-forward path), and the
scheduler sends a resumed request as a new one with prefill_token_ids.

Engine-side checks (an EngineError names the vLLM assertion or contract):
a synchronous hit covering every token, (0, True), finished_recving for a
running request, finished_sending for a request whose free was not delayed
(or already freed), build_connector_meta changing the SchedulerOutput,
request_finished* not returning (bool, params).

KV memory: one kvside.HostMemory (memfd) per KVCacheTensor, seen as torch
tensors through numpy.frombuffer + torch.from_numpy (the mapping stays
exported), in vLLM's layouts: attention layers logical
(num_blocks, H, block_size, 2*head_size) over physical NHD
(num_blocks, block_size, H, 2*head_size); one raw buffer per layer index
shared by one layer of each group (hybrid); Mamba layers int8
[num_blocks, 1, 1, padded page].

CUDA (KVT_DEVICE=cuda): each rank (on GPU rank % device count) allocates
every KVCacheTensor on the GPU instead, in the same layouts, as vLLM's
_allocate_kv_cache_tensors does (torch.zeros(size, int8)):
KVT_CUDA_ALLOC=torch (default) a plain torch allocation, which libkvside
exports as legacy CUDA IPC; KVT_CUDA_ALLOC=kvside kvside.torch_alloc.empty
(cuMem, POSIX fds). The mock model's bytes still come from the CPU: writes
are pinned host rows copied non_blocking and scattered (index_copy_) on the
current stream, the Mamba pre-copy and the zeroing of new_block_ids_to_zero
are device ops on the current stream, and nothing waits for them: as in
vLLM, only the connector's wait_for_save (which must synchronise the stream
before the server copies) and the engine's own reads order them. The output
digests gather their spans on the stream before wait_for_save and copy them
to the host after the connector output (vLLM's sampled-token copy); the
prefix checks and Mamba state reads copy at once. KVT_CUDA_DELAY_US (default
300, 0: off) enqueues a spin kernel of that length at the start of every
step and before every layer's writes: the GPU still busy with earlier work,
as under vLLM's async scheduling, so that a copy the connector starts
without ordering it after the stream sees stale or unzeroed bytes.
KVT_CUDA_WRITE_STREAM=side is a control that breaks that ordering on
purpose: the writes (and their spins) go to a side stream that waits for the
current one and that the current one waits for only after the connector
output, so a store the connector starts after synchronising the current
stream may copy stale bytes (the engine's own reads stay right; loads then
find wrong bytes and the cases must fail). KVT_DEVICE=torch-cpu runs the
torch code path on the host memory above (no GPU, no pinning, no delay): a
check of the engine itself.

Mock model (MockModel): the KV of position p in layer l on rank r is a hash
of tokens[0..p]; a Mamba state is a hash chain over the tokens, read from
and written to its state block; a step's output for a request is a digest
of what its last token attends to, read back from the blocks (full layers:
positions 0..end-1; sliding-window layers: the last ``window`` positions;
Mamba: the state); the ranks' digests are combined (the all-reduce) and the
next token is that value mod vocab. Generated tokens are therefore identical
whether a prefix was loaded or computed, and any wrong byte changes them.
``MockModel.generate`` computes the same tokens without an engine.
"""

import collections
import contextlib
import faulthandler
import hashlib
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# model description (plain data: travels to the spawned processes)


@dataclass
class GroupDef:
    kind: str                 # "full" | "swa" | "mamba"
    block_size: int
    layers: int               # layers of this group
    num_kv_heads: int = 2     # per rank (attention)
    head_size: int = 8
    sliding_window: int = 0   # swa
    mamba_shapes: tuple = ((8, 3), (2, 4, 8))     # per rank: conv, ssm
    mamba_dtypes: tuple = ("float16", "float32")


@dataclass
class ModelSpec:
    name: str = "mock-model"
    tp: int = 2
    groups: list = field(default_factory=lambda: [GroupDef("full", 16, 3)])
    num_blocks: int = 256
    dtype: str = "float16"
    vocab: int = 50021
    max_num_batched_tokens: int = 96
    max_num_seqs: int = 16
    pool_policy: str = "fifo"  # "fifo" as vLLM's free queue; "lifo" reuses freed blocks first
    cache_block_size: int = 0  # cache_config.block_size (0: the first group's)
    runner: str = "v1"         # "v1" (GPUModelRunner; hybrid models) | "v2" (default for dense models)


NULL = 0


def cdiv(a, b):
    return -(a // -b)


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def _dtype_size(name):
    return {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}[name]


def layer_names(spec):
    """[(layer name, group index, layer index)] in model order: layer i of
    every group in turn (a hybrid model interleaves its layer kinds)."""
    out, idx = [], 0
    most = max(g.layers for g in spec.groups)
    for i in range(most):
        for gi, g in enumerate(spec.groups):
            if i < g.layers:
                if g.kind == "mamba":
                    out.append(("model.layers.%d.mixer" % idx, gi, idx))
                else:
                    out.append(("model.layers.%d.self_attn.attn" % idx, gi, idx))
                idx += 1
    return out


def attn_token_bytes(g, dtype):
    return g.num_kv_heads * 2 * g.head_size * _dtype_size(dtype)


def mamba_state_bytes(g):
    n = 0
    for shape, dt in zip(g.mamba_shapes, g.mamba_dtypes):
        k = 1
        for d in shape:
            k *= d
        n += k * _dtype_size(dt)
    return n


def page_bytes(spec):
    """The common page size (vLLM unifies the groups' page sizes; a Mamba
    page is padded to the attention page)."""
    att = {g.block_size * attn_token_bytes(g, spec.dtype) for g in spec.groups if g.kind != "mamba"}
    if len(att) > 1:
        raise ValueError("attention groups must have one page size (vLLM unifies them), got %s" % att)
    page = att.pop() if att else max(mamba_state_bytes(g) for g in spec.groups)
    for g in spec.groups:
        if g.kind == "mamba" and mamba_state_bytes(g) > page:
            raise ValueError("a Mamba state (%d B) is larger than the attention page (%d B)"
                             % (mamba_state_bytes(g), page))
    return page


def build_configs(spec, connector=None, extra_config=None, engine_id="engine-0",
                  load_failure_policy="recompute"):
    """(VllmConfig, KVCacheConfig) for this model, as vLLM would build them
    (kv_cache_utils.get_kv_cache_config_from_groups: one KVCacheTensor per
    layer index, shared by one layer of each group, page sizes unified)."""
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            KVCacheTensor, MambaSpec, SlidingWindowSpec)
    page = page_bytes(spec)
    hybrid = len(spec.groups) > 1
    names = layer_names(spec)
    groups = []
    for gi, g in enumerate(spec.groups):
        dt = _torch_dtype(spec.dtype)
        if g.kind == "full":
            s = FullAttentionSpec(block_size=g.block_size, num_kv_heads=g.num_kv_heads, head_size=g.head_size,
                                  dtype=dt)
        elif g.kind == "swa":
            s = SlidingWindowSpec(block_size=g.block_size, num_kv_heads=g.num_kv_heads, head_size=g.head_size,
                                  dtype=dt, sliding_window=g.sliding_window)
        elif g.kind == "mamba":
            s = MambaSpec(block_size=g.block_size, shapes=tuple(tuple(x) for x in g.mamba_shapes),
                          dtypes=tuple(_torch_dtype(d) for d in g.mamba_dtypes),
                          page_size_padded=page if page != mamba_state_bytes(g) else None,
                          mamba_cache_mode="align")
        else:
            raise ValueError(g.kind)
        groups.append(KVCacheGroupSpec([n for n, gg, _ in names if gg == gi], s))
    tensors = []
    if hybrid:
        for i in range(max(len(g.layer_names) for g in groups)):
            tensors.append(KVCacheTensor(size=page * spec.num_blocks,
                                         shared_by=[g.layer_names[i] for g in groups if i < len(g.layer_names)]))
    else:
        for n in groups[0].layer_names:
            tensors.append(KVCacheTensor(size=page * spec.num_blocks, shared_by=[n]))
    kcc = KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    ktc = None
    if connector is not None:
        module, cls = connector
        ktc = KVTransferConfig(kv_connector=cls, kv_connector_module_path=module, kv_role="kv_both",
                               engine_id=engine_id, kv_connector_extra_config=dict(extra_config or {}),
                               kv_load_failure_policy=load_failure_policy)
    has_mamba = any(g.kind == "mamba" for g in spec.groups)
    cbs = spec.cache_block_size or next((g.block_size for g in spec.groups if g.kind == "mamba"),
                                        spec.groups[0].block_size)
    vc = VllmConfig(model_config=ModelConfig(model=spec.name, dtype=spec.dtype, max_model_len=4096),
                    cache_config=CacheConfig(block_size=cbs, cache_dtype="auto",
                                             mamba_cache_mode="align" if has_mamba else "none"),
                    parallel_config=ParallelConfig(tensor_parallel_size=spec.tp),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                                     max_num_seqs=spec.max_num_seqs,
                                                     disable_hybrid_kv_cache_manager=False),
                    kv_transfer_config=ktc, use_v2_model_runner=spec.runner == "v2")
    return vc, kcc


def hash_block_size(spec):
    """vLLM's hash block size (kv_cache_utils.resolve_kv_cache_block_sizes,
    B:L606): one group: its block size; several: their gcd (Mamba in align
    mode uses cache_config.block_size)."""
    from math import gcd
    h = 0
    for g in spec.groups:
        h = gcd(h, g.block_size)
    return h


# ---------------------------------------------------------------------------------------------
# the mock model


def _h(data, size=32, person=b""):
    return hashlib.blake2b(data, digest_size=size, person=person).digest()


class MockModel:
    """Deterministic bytes for every (layer, rank, position); see the module
    docstring. Shared by the workers and the engine-free oracle."""

    def __init__(self, spec):
        self.spec = spec
        self.layers = layer_names(spec)
        self.page = page_bytes(spec)

    @staticmethod
    def pos_hashes(tokens, upto, cache):
        """cache: list of chained 16-byte hashes of tokens[0..p]; extended to upto."""
        prev = cache[-1] if cache else b"\0" * 16
        for p in range(len(cache), upto):
            prev = _h(prev + int(tokens[p]).to_bytes(4, "little"), 16)
            cache.append(prev)
        return cache

    def kv_bytes(self, layer_idx, rank, pos_hash, nbytes):
        d = _h(pos_hash + bytes([layer_idx & 255, rank & 255]), 64, b"kv")
        if nbytes <= 64:
            return d[:nbytes]
        return (d * cdiv(nbytes, 64))[:nbytes]

    @staticmethod
    def mamba_init(layer_idx, rank):
        return _h(b"mamba-init" + bytes([layer_idx & 255, rank & 255]))

    @staticmethod
    def mamba_fold(d, tokens):
        for t in tokens:
            d = _h(d + int(t).to_bytes(4, "little"), 32, b"ssm")
        return d

    @staticmethod
    def expand(d, n):
        out = bytearray(d)
        while len(out) < n:
            out += _h(bytes(out[-32:]) + b"e")
        return bytes(out[:n])

    def decode_state(self, b):
        """The digest a state's bytes stand for (a wrong byte anywhere gives
        another digest, so it propagates)."""
        d = bytes(b[:32])
        if self.expand(d, len(b)) != bytes(b):
            d = _h(b"corrupt" + bytes(b))
        return d

    @staticmethod
    def attn_span(g, end):
        """Positions the token at end-1 attends to: [lo, end)."""
        if g.kind == "swa":
            return max(0, end - g.sliding_window), end
        return 0, end

    @staticmethod
    def combine(digests, vocab):
        """The all-reduce + greedy sampling: digests in rank order -> token."""
        return int.from_bytes(_h(b"".join(digests), 8, b"sample"), "little") % vocab

    def generate(self, prompt, max_tokens):
        """The tokens an engine must produce for this prompt, computed
        directly (no blocks, no connector)."""
        toks = list(prompt)
        out = []
        hashes = []
        for _ in range(max_tokens):
            end = len(toks)
            self.pos_hashes(toks, end, hashes)
            digs = []
            for r in range(self.spec.tp):
                h = hashlib.blake2b(digest_size=32)
                for name, gi, li in self.layers:
                    g = self.spec.groups[gi]
                    h.update(name.encode())
                    if g.kind == "mamba":
                        d = self.mamba_fold(self.mamba_init(li, r), toks[:end])
                        h.update(self.expand(d, mamba_state_bytes(g)))
                    else:
                        lo, hi = self.attn_span(g, end)
                        nb = attn_token_bytes(g, self.spec.dtype)
                        h.update(b"".join(self.kv_bytes(li, r, hashes[p], nb) for p in range(lo, hi)))
                digs.append(h.digest())
            t = self.combine(digs, self.spec.vocab)
            out.append(t)
            toks.append(t)
        return out


# ---------------------------------------------------------------------------------------------
# worker process


class EngineError(Exception):
    """The engine (standing in for vLLM) found a contract violation or broke."""


class _AttnMeta:
    """Stand-in attention metadata handed to save_kv_layer (vLLM's backend
    metadata; connectors read slot_mapping at most)."""

    def __init__(self, slot_mapping, num_actual_tokens):
        self.slot_mapping = slot_mapping
        self.num_actual_tokens = num_actual_tokens


class _Layer:
    def __init__(self, kv_cache):
        self.kv_cache = [kv_cache]


class _ReqState:
    __slots__ = ("tokens", "tables", "num_computed", "hashes")

    def __init__(self, tokens, tables, num_computed):
        self.tokens, self.tables, self.num_computed, self.hashes = list(tokens), tables, num_computed, []


class Worker:
    """One TP rank: GPUModelRunner + GPU worker with the V1 KV-connector mixin."""

    def __init__(self, spec, rank, connector, extra_config, engine_id):
        import numpy as np
        import torch
        import kvside
        from vllm.distributed.parallel_state import set_tensor_model_parallel
        self.np, self.torch = np, torch
        self.spec, self.rank = spec, rank
        self.model = MockModel(spec)
        set_tensor_model_parallel(rank, spec.tp)
        self.vllm_config, self.kcc = build_configs(spec, connector, extra_config, engine_id)
        self.connector = None
        if connector is not None:
            # the connector is built before initialize_kv_cache (gpu_worker.initialize_from_config)
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
            self.connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                                 self.kcc)
        self.timing = {}
        if self.connector is not None:
            _timed(self.connector, WORKER_CALLS, self.timing)
        nb, page = spec.num_blocks, self.model.page
        self.mems, self.raw_np, self.kv_caches, self.phys = [], [], {}, {}
        # the torch path (KVT_DEVICE=cuda or torch-cpu): raw tensors, per layer
        # its pages (nb, page) and attention layers' token rows (nb * bs, token bytes)
        self.kv_device = os.environ.get("KVT_DEVICE", "cpu")
        if self.kv_device not in ("cpu", "cuda", "torch-cpu"):
            raise EngineError("KVT_DEVICE=%s: expected cpu, cuda or torch-cpu" % self.kv_device)
        self.on_torch = self.kv_device != "cpu"
        self.cuda = self.kv_device == "cuda"
        self.raw_t, self.tphys, self.trows = [], {}, {}
        self.tdev = torch.device("cpu")
        self.delay_cycles = 0
        self.wstream = None
        if self.cuda:
            self.tdev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.tdev)
            self.cuda_alloc = os.environ.get("KVT_CUDA_ALLOC", "torch")
            if self.cuda_alloc not in ("torch", "kvside"):
                raise EngineError("KVT_CUDA_ALLOC=%s: expected torch or kvside" % self.cuda_alloc)
            # torch.cuda._sleep spins this many clock cycles (about 2 per ns on an H200)
            self.delay_cycles = int(float(os.environ.get("KVT_CUDA_DELAY_US", "300")) * 2000)
            if self.delay_cycles and not hasattr(torch.cuda, "_sleep"):
                print("rank %d: torch %s has no torch.cuda._sleep: KVT_CUDA_DELAY_US ignored"
                      % (rank, torch.__version__), file=sys.stderr)
                self.delay_cycles = 0
            ws = os.environ.get("KVT_CUDA_WRITE_STREAM", "current")
            if ws not in ("current", "side"):
                raise EngineError("KVT_CUDA_WRITE_STREAM=%s: expected current or side" % ws)
            if ws == "side":
                self.wstream = torch.cuda.Stream(self.tdev)
        layer_group = {n: (gi, li) for n, gi, li in layer_names(spec)}
        for t in self.kcc.kv_cache_tensors:
            if self.cuda:
                if self.cuda_alloc == "kvside":
                    from kvside import torch_alloc
                    raw = torch_alloc.empty((t.size,), dtype=torch.int8, device=self.tdev)
                else:
                    raw = torch.empty(t.size, dtype=torch.int8, device=self.tdev)
                raw.zero_()
            else:
                mem = kvside.HostMemory(t.size, name="vllm-kv-r%d" % rank)
                self.mems.append(mem)
                arr = np.frombuffer(mem.buffer, dtype=np.uint8)     # keeps the mmap exported
                raw = torch.from_numpy(arr).view(torch.int8)
            if self.on_torch:
                self.raw_t.append(raw)
            else:
                self.raw_np.append(arr)
            for name in t.shared_by:
                gi, li = layer_group[name]
                g = spec.groups[gi]
                if g.kind == "mamba":
                    self.kv_caches[name] = raw[:nb * page].view(nb, 1, 1, page)
                else:
                    phys = raw.view(_torch_dtype(spec.dtype)).view(nb, g.block_size, g.num_kv_heads,
                                                                   2 * g.head_size)
                    self.kv_caches[name] = phys.permute(0, 2, 1, 3)   # logical (nb, H, bs, 2D), NHD order
                if self.on_torch:
                    u8 = raw[:nb * page].view(torch.uint8)
                    self.tphys[name] = u8.view(nb, page)
                    if g.kind != "mamba":
                        tb = attn_token_bytes(g, spec.dtype)
                        if g.block_size * tb != page:
                            raise EngineError("%s: page %d B is not %d tokens of %d B" % (name, page, g.block_size,
                                                                                        tb))
                        self.trows[name] = u8.view(nb * g.block_size, tb)
                else:
                    self.phys[name] = arr[:nb * page].reshape(nb, page)
        if self.cuda:
            torch.cuda.synchronize(self.tdev)
        self.layers = layer_names(spec)
        self.no_compile_layers = {n: _Layer(t) for n, t in self.kv_caches.items()}
        self.has_mamba = any(g.kind == "mamba" for g in spec.groups)
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches)
            self.connector.set_host_xfer_buffer_ops(_copy_blocks)
        self.reqs = {}

    # -- vLLM's _update_states

    def _update_states(self, so):
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.tables = None
        if so.new_block_ids_to_zero:
            if self.on_torch:
                # vLLM's _zero_block_ids: device ops on the current stream, not waited for
                ids = self._t_index(sorted(set(so.new_block_ids_to_zero)))
                for raw in self.raw_t:
                    raw.view(self.spec.num_blocks, -1).index_fill_(0, ids, 0)
            else:
                ids = self.np.array(sorted(set(so.new_block_ids_to_zero)), dtype=self.np.int64)
                for arr in self.raw_np:
                    arr.reshape(self.spec.num_blocks, -1)[ids] = 0
        for nr in so.scheduled_new_reqs:
            toks = nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids
            self.reqs[nr.req_id] = _ReqState(toks, [list(t) for t in nr.block_ids], nr.num_computed_tokens)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.reqs[rid]
            if rid in cr.resumed_req_ids:
                st.tables = [list(t) for t in cr.new_block_ids[i]]
                if rid in cr.all_token_ids:
                    st.tokens = list(cr.all_token_ids[rid])
                    st.hashes = st.hashes[:len(st.tokens)]
            else:
                if cr.new_block_ids[i] is not None:
                    for t, new in zip(st.tables, cr.new_block_ids[i]):
                        t.extend(new)
            if cr.new_token_ids and cr.new_token_ids[i]:
                st.tokens.extend(cr.new_token_ids[i])
            st.num_computed = cr.num_computed_tokens[i]

    # -- KV access

    def _slot(self, st, gi, p, what):
        g = self.spec.groups[gi]
        t = st.tables[gi]
        i = p // g.block_size
        if i >= len(t):
            raise EngineError("rank %d: position %d of %s has no block in group %d (table of %d)"
                              % (self.rank, p, what, gi, len(t)))
        return t[i], p % g.block_size

    def _read_span(self, name, gi, st, lo, hi, gather=False):
        """The bytes of positions [lo, hi) of a request in an attention layer.
        gather (torch path): a tensor gathered on the current stream instead,
        read later (_Digest.digest)."""
        g = self.spec.groups[gi]
        if hi <= lo:
            return b""
        bs, tb = g.block_size, attn_token_bytes(g, self.spec.dtype)
        first, last = lo // bs, (hi - 1) // bs
        ids = [st.tables[gi][i] if i < len(st.tables[gi]) else NULL for i in range(first, last + 1)]
        off = (lo - first * bs) * tb
        if self.on_torch:
            data = self.tphys[name][self._t_index(ids)].reshape(-1)[off:off + (hi - lo) * tb]
            return data if gather else self._t_bytes(data)
        data = self.phys[name][self.np.array(ids, dtype=self.np.int64)].reshape(-1)
        return data[off:off + (hi - lo) * tb].tobytes()

    # -- the torch path (KVT_DEVICE=cuda / torch-cpu)

    def _t_index(self, ids):
        """An int64 index tensor on the KV device (copied on the current stream)."""
        t = self.torch.tensor(list(ids), dtype=self.torch.int64)
        return t.pin_memory().to(self.tdev, non_blocking=True) if self.cuda else t

    def _t_rows(self, data, n):
        """Host bytes as an (n, len/n) uint8 tensor on the KV device, copied
        from pinned memory on the current stream (not waited for)."""
        t = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8).view(n, -1)
        return t.pin_memory().to(self.tdev, non_blocking=True) if self.cuda else t

    def _t_bytes(self, t):
        """A tensor's bytes on the host (a device-to-host copy: waits for the stream)."""
        return t.cpu().numpy().tobytes()

    def _gpu_busy(self):
        """KVT_CUDA_DELAY_US: a spin kernel ahead of what follows on the stream."""
        if self.delay_cycles:
            self.torch.cuda._sleep(self.delay_cycles)

    def _writes(self):
        """Where the model's KV writes go: the current stream (as vLLM), or
        with KVT_CUDA_WRITE_STREAM=side a side stream after the current one."""
        if self.wstream is None:
            return contextlib.nullcontext()
        self.wstream.wait_stream(self.torch.cuda.current_stream())
        return self.torch.cuda.stream(self.wstream)

    def _mamba_block(self, gi, st, n_tokens):
        g = self.spec.groups[gi]
        i = cdiv(n_tokens, g.block_size) - 1
        return st.tables[gi][i] if 0 <= i < len(st.tables[gi]) else NULL

    # -- one step

    def execute(self, so, extra):
        c = self.connector
        checks = []
        v2 = self.spec.runner == "v2"
        self._gpu_busy()
        if c is not None:
            if so.kv_connector_metadata is None:
                raise EngineError("SchedulerOutput without kv_connector_metadata")
            if not v2:
                # V1: first thing in execute_model, before zeroing and the Mamba pre-copy
                c.handle_preemptions(so.kv_connector_metadata)
        self._update_states(so)
        from vllm.forward_context import get_forward_context, set_forward_context
        if so.total_num_scheduled_tokens == 0:
            # V1 kv_connector_no_forward / V2 ActiveKVConnector.no_forward:
            # no wait_for_save, no per-layer calls
            if c is None:
                return {"digests": {}, "kv": None, "checks": checks}
            with set_forward_context(None, self.vllm_config, no_compile_layers=self.no_compile_layers):
                if v2:
                    c.handle_preemptions(so.kv_connector_metadata)
                return {"digests": {}, "kv": self._connector_output(so, wait_for_save=False),
                        "checks": checks}
        sched = [(rid, n) for rid, n in so.num_scheduled_tokens.items()]
        for rid, n in sched:
            st = self.reqs[rid]
            if st.tables is None:
                raise EngineError("rank %d: %s scheduled without a block table" % (self.rank, rid))
            self.model.pos_hashes(st.tokens, st.num_computed + n, st.hashes)
        # Mamba "align" pre-copy (preprocess_mamba), enqueued before start_load_kv
        for gi, g in enumerate(self.spec.groups):
            if g.kind != "mamba":
                continue
            sb = mamba_state_bytes(g)
            for rid, n in sched:
                st = self.reqs[rid]
                nc = st.num_computed
                prev = (nc - 1) // g.block_size if nc > 0 else -1
                curr = cdiv(nc + n, g.block_size) - 1
                if prev != -1 and prev != curr:
                    src, dst = st.tables[gi][prev], st.tables[gi][curr]
                    for name, lg, li in self.layers:
                        if lg == gi:
                            if self.on_torch:
                                self.tphys[name][dst, :sb].copy_(self.tphys[name][src, :sb])
                            else:
                                self.phys[name][dst, :sb] = self.phys[name][src, :sb]
        check = extra.get("check", {})
        attn_meta = {}
        for name, gi, li in self.layers:
            g = self.spec.groups[gi]
            if g.kind == "mamba":
                continue
            slots = []
            for rid, n in sched:
                st = self.reqs[rid]
                for p in range(st.num_computed, st.num_computed + n):
                    b, o = self._slot(st, gi, p, rid)
                    slots.append(b * g.block_size + o)
            attn_meta[name] = _AttnMeta(self.torch.tensor(slots, dtype=self.torch.int64), len(slots))
        digests = {rid: _Digest() for rid, n in sched
                   if self.reqs[rid].num_computed + n == len(self.reqs[rid].tokens)}
        with set_forward_context(attn_meta, self.vllm_config, no_compile_layers=self.no_compile_layers):
            if c is not None:
                if v2:
                    # V2 pre_forward: after _update_states (zeroing) and the state pre-copy
                    c.handle_preemptions(so.kv_connector_metadata)
                c.bind_connector_metadata(so.kv_connector_metadata)
                c.start_load_kv(get_forward_context())
            for name, gi, li in self.layers:
                g = self.spec.groups[gi]
                if g.kind == "mamba":
                    self._mamba_layer(name, gi, li, sched, check, checks, digests)
                    continue
                if c is not None:
                    c.wait_for_layer_load(name)
                tb = attn_token_bytes(g, self.spec.dtype)
                with self._writes():
                    self._gpu_busy()
                for rid, n in sched:
                    st = self.reqs[rid]
                    if rid in check:
                        self._check_attention(name, gi, li, rid, st, check[rid], checks)
                    rows, slots = [], []
                    for p in range(st.num_computed, st.num_computed + n):
                        b, o = self._slot(st, gi, p, rid)
                        if b == NULL:
                            raise EngineError("rank %d: %s position %d maps to the null block in group %d"
                                              % (self.rank, rid, p, gi))
                        kvb = self.model.kv_bytes(li, self.rank, st.hashes[p], tb)
                        if self.on_torch:
                            rows.append(kvb)
                            slots.append(b * g.block_size + o)
                        else:
                            self.phys[name][b, o * tb:(o + 1) * tb] = self.np.frombuffer(kvb, dtype=self.np.uint8)
                    if slots:
                        # one scatter per layer and request, on the current stream
                        # (the control: on the side stream)
                        with self._writes():
                            self.trows[name].index_copy_(0, self._t_index(slots),
                                                         self._t_rows(b"".join(rows), len(slots)))
                    if rid in digests:
                        lo, hi = MockModel.attn_span(g, st.num_computed + n)
                        digests[rid].update(name.encode())
                        with self._writes():
                            digests[rid].update(self._read_span(name, gi, st, lo, hi, gather=True))
                if c is not None:
                    c.save_kv_layer(name, self.kv_caches[name], attn_meta[name])
            kv = self._connector_output(so, wait_for_save=True) if c is not None else None
        if self.wstream is not None:
            self.torch.cuda.current_stream().wait_stream(self.wstream)
        # the outputs reach the host after the forward and the connector's
        # wait_for_save (vLLM's sampled-token copy)
        return {"digests": {rid: h.digest(self._t_bytes) for rid, h in digests.items()}, "kv": kv,
                "checks": checks}

    def _mamba_layer(self, name, gi, li, sched, check, checks, digests):
        g = self.spec.groups[gi]
        sb = mamba_state_bytes(g)
        for rid, n in sched:
            st = self.reqs[rid]
            nc = st.num_computed
            b = self._mamba_block(gi, st, nc + n)
            if b == NULL:
                raise EngineError("rank %d: %s has no Mamba state block for %d tokens" % (self.rank, rid, nc + n))
            if nc == 0:
                d = MockModel.mamba_init(li, self.rank)
            else:
                cur = self._t_bytes(self.tphys[name][b, :sb]) if self.on_torch else self.phys[name][b, :sb].tobytes()
                if rid in check:
                    want = self.model.expand(MockModel.mamba_fold(MockModel.mamba_init(li, self.rank),
                                                                  st.tokens[:nc]), sb)
                    if cur != want:
                        prev = (nc - 1) // g.block_size
                        checks.append({"rid": rid, "layer": name, "rank": self.rank, "kind": "mamba",
                                       "pos": nc, "block": st.tables[gi][prev], "read_block": b,
                                       "zero": not any(cur)})
                d = self.model.decode_state(cur)
            d = MockModel.mamba_fold(d, st.tokens[nc:nc + n])
            state = self.model.expand(d, sb)
            if self.on_torch:
                with self._writes():
                    self._gpu_busy()
                    self.tphys[name][b, :sb].copy_(self._t_rows(state, 1)[0], non_blocking=True)
            else:
                self.phys[name][b, :sb] = self.np.frombuffer(state, dtype=self.np.uint8)
            if rid in digests:
                digests[rid].update(name.encode())
                digests[rid].update(state)

    def _check_attention(self, name, gi, li, rid, st, n_loaded, checks):
        """The bytes a loaded prefix must hold, for the positions this step
        reads (full: all; window: the last window-1 before n_loaded)."""
        g = self.spec.groups[gi]
        lo = 0 if g.kind == "full" else max(0, n_loaded - g.sliding_window + 1)
        tb = attn_token_bytes(g, self.spec.dtype)
        got = self._read_span(name, gi, st, lo, n_loaded)
        for p in range(lo, n_loaded):
            want = self.model.kv_bytes(li, self.rank, st.hashes[p], tb)
            if got[(p - lo) * tb:(p - lo + 1) * tb] != want:
                b, o = self._slot(st, gi, p, rid)
                checks.append({"rid": rid, "layer": name, "rank": self.rank, "kind": g.kind, "pos": p,
                               "block": b, "zero": not any(got[(p - lo) * tb:(p - lo + 1) * tb])})
                return

    def _connector_output(self, so, wait_for_save):
        """kv_connector_model_runner_mixin._get_kv_connector_output (B mixin L78)."""
        from vllm.forward_context import get_forward_context
        from vllm.v1.outputs import KVConnectorOutput
        c = self.connector
        out = KVConnectorOutput()
        if not c.has_connector_metadata():
            c.bind_connector_metadata(so.kv_connector_metadata)
            c.start_load_kv(get_forward_context())
        if wait_for_save:
            c.wait_for_save()
        tr = c.get_transfer_results(so.finished_req_ids)
        out.finished_sending, out.finished_recving = tr.finished_sending, tr.finished_recving
        out.failed_recving = tr.failed_recving
        out.invalid_block_ids = c.get_block_ids_with_load_errors()
        out.kv_connector_stats = c.get_kv_connector_stats()
        out.kv_cache_events = c.get_kv_connector_kv_cache_events()
        out.kv_connector_worker_meta = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return out

    def shutdown(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.tdev)
        if self.connector is not None:
            self.connector.shutdown()


class _Digest:
    """A step output's hash, fed bytes or (torch path) tensors gathered on
    the stream, which are read only when the digest is taken."""

    def __init__(self):
        self.parts = []

    def update(self, part):
        self.parts.append(part)

    def digest(self, to_bytes):
        h = hashlib.blake2b(digest_size=32)
        for p in self.parts:
            h.update(p if isinstance(p, bytes) else to_bytes(p))
        return h.digest()


def _timed(obj, names, table):
    """Wraps obj's methods so that table[name] holds (calls, max seconds)."""
    for name in names:
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **kw):
            t0 = time.monotonic()
            try:
                return _fn(*a, **kw)
            finally:
                dt = time.monotonic() - t0
                n, mx = table.get(_name, (0, 0.0))
                table[_name] = (n + 1, max(mx, dt))
        setattr(obj, name, wrap)


WORKER_CALLS = ("register_kv_caches", "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats")
SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups")


def _copy_blocks(src, dst, src_idx, dst_idx, direction):
    """set_host_xfer_buffer_ops' copy operation (unused by these connectors)."""
    for name in src:
        dst[name][dst_idx] = src[name][src_idx]


def _setup_process(log_path):
    f = open(log_path, "ab", buffering=0)
    os.dup2(f.fileno(), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    import logging
    logging.basicConfig(level=os.environ.get("KVT_LOG_LEVEL", "WARNING").upper(), stream=sys.stderr,
                        format="%(asctime)s " + os.path.basename(log_path) + " %(name)s %(levelname)s %(message)s")


def worker_main(conn, rank, spec, connector, extra_config, engine_id, log_path):
    _setup_process(log_path)
    try:
        w = Worker(spec, rank, connector, extra_config, engine_id)
        conn.send(("ready", rank))
    except BaseException:
        conn.send(("error", "rank %d init:\n%s" % (rank, traceback.format_exc())))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        try:
            if msg[0] == "step":
                out = w.execute(msg[1], msg[2])
                out["timing"] = dict(w.timing)
                w.timing.clear()
                conn.send(("ok", out))
            elif msg[0] == "shutdown":
                w.shutdown()
                conn.send(("bye", rank))
                return
        except BaseException:
            conn.send(("error", "rank %d step %s:\n%s" % (rank, msg[0], traceback.format_exc())))


# ---------------------------------------------------------------------------------------------
# scheduler process


class BlockPool:
    """vLLM's BlockPool without the prefix cache: block 0 is the null block,
    never handed out; freed blocks go to the tail of the free queue (fifo, as
    vLLM) or to its head (lifo: the next allocation reuses them)."""

    def __init__(self, num_blocks, policy):
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free = collections.deque(self.blocks[1:])
        self.policy = policy

    def get_num_free_blocks(self):
        return len(self.free)

    def get_new_blocks(self, n):
        if n > len(self.free):
            raise EngineError("block pool: %d blocks asked, %d free" % (n, len(self.free)))
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            assert b.ref_cnt == 0, b
            b.ref_cnt = 1
        return out

    def free_blocks(self, blocks):
        for b in blocks:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            assert b.ref_cnt == 0, b
            if self.policy == "lifo":
                self.free.appendleft(b)
            else:
                self.free.append(b)


class KVOutputAggregator:
    """vllm/distributed/kv_transfer/kv_connector/utils.py KVOutputAggregator (B:L53):
    an id is finished once ``expected`` workers reported it (kept across steps)."""

    def __init__(self, expected):
        self.expected = expected
        self.send, self.recv = {}, {}
        self.failed_pending = set()  # reported failed by some worker; out once finished by all

    def aggregate(self, outputs):
        from vllm.v1.outputs import KVConnectorOutput
        fs, fr, invalid = set(), set(), set()
        stats = meta = None
        events = []
        for o in outputs:
            if o is None:
                continue
            if o.expected_finished_count:
                self.expected = o.expected_finished_count
            for ids, counts, done in ((o.finished_sending, self.send, fs), (o.finished_recving, self.recv, fr)):
                for rid in ids or ():
                    counts[rid] = counts.get(rid, 0) + 1
                    if counts[rid] == self.expected:
                        del counts[rid]
                        done.add(rid)
            invalid |= set(o.invalid_block_ids or ())
            self.failed_pending |= set(getattr(o, "failed_recving", None) or ())
            if o.kv_connector_stats is not None:
                stats = o.kv_connector_stats if stats is None else stats.aggregate(o.kv_connector_stats)
            if o.kv_connector_worker_meta is not None:
                meta = (o.kv_connector_worker_meta if meta is None
                        else meta.aggregate(o.kv_connector_worker_meta))
            if o.kv_cache_events is not None:
                events.append(o.kv_cache_events)
        failed = self.failed_pending & fr
        self.failed_pending -= failed
        return KVConnectorOutput(finished_sending=fs or None, finished_recving=fr or None, failed_recving=failed,
                                 kv_connector_stats=stats, kv_cache_events=events or None,
                                 kv_connector_worker_meta=meta, invalid_block_ids=invalid)


class Scheduler:
    def __init__(self, spec, connector, extra_config, engine_id, workers, hook, step_timeout):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        self.spec = spec
        self.vllm_config, self.kcc = build_configs(spec, connector, extra_config, engine_id)
        self.groups = spec.groups
        self.sched_block_size = 1
        for g in spec.groups:
            self.sched_block_size = self.sched_block_size * g.block_size // _gcd(self.sched_block_size,
                                                                                  g.block_size)
        self.mamba_bs = next((g.block_size for g in spec.groups if g.kind == "mamba"), 0)
        self.needs_zeroing = self.kcc.needs_kv_cache_zeroing
        self.pool = BlockPool(spec.num_blocks, spec.pool_policy)
        self.connector = None
        if connector is not None:
            self.connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                                                 self.kcc)
            self.connector.bind_gpu_block_pool(self.pool)
        self.timing = {"scheduler": {}, "workers": {}}
        if self.connector is not None:
            _timed(self.connector, SCHEDULER_CALLS, self.timing["scheduler"])
        self.hma = self.connector is not None and isinstance(self.connector, SupportsHMA)
        ktc = self.vllm_config.kv_transfer_config
        self.recompute_failures = ktc is not None and ktc.kv_load_failure_policy == "recompute"
        self.hasher = get_request_block_hasher(hash_block_size(spec))
        self.workers, self.hook, self.step_timeout = workers, hook, step_timeout
        self.agg = KVOutputAggregator((self.connector.get_finished_count() if self.connector else None)
                                      or spec.tp)
        self.requests = {}           # every request not yet freed
        self.waiting = collections.deque()
        self.running = []
        self.tables = {}             # rid -> [list of KVCacheBlock per group]
        self.allocated = set()       # Mamba: requests whose running state block exists
        self.inflight_prefills = set()   # async loaders and requests still prefilling (their reservation)
        self.pending_aborts = []         # ids a test hook asked to abort (applied before the next schedule)
        self.last_state_idx = {}     # Mamba align
        self.finished_req_ids = set()
        self.preempted_ids = set()
        self.finished_recving = set()
        self.failed_recving = set()
        self.scheduled_before = set()
        self.tokens_sent = {}        # rid -> tokens the workers know
        self.step = 0
        self.log = []                # notable events, for the test report
        self.checks = []             # byte checks that failed (after excusing reported load errors)
        self.bad_blocks = collections.defaultdict(set)
        self.stats = None
        self.info = {}
        self.outputs = {}
        from vllm.v1.request import RequestStatus
        self._status = RequestStatus

    # -- requests

    def add_request(self, r):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        req = Request(r["id"], list(r["prompt"]), SamplingParams(max_tokens=r["max_tokens"]),
                      cache_salt=r.get("cache_salt"), block_hasher=self.hasher)
        self.requests[req.request_id] = req
        self.outputs[req.request_id] = req._output_token_ids
        self.waiting.append(req)
        self.info[req.request_id] = {"ext": [], "preemptions": 0, "recomputes": [], "finish_step": None,
                                     "arrive_step": self.phase_step, "load_checks": 0}
        if self.connector is not None:
            self.connector.on_new_request(req)

    # -- KV cache manager

    def _skipped_tokens(self, g, n):
        if g.kind == "swa":
            return max(0, n - g.sliding_window + 1)
        if g.kind == "mamba":
            return n - 1
        return 0

    def remove_skipped_blocks(self, rid, n):
        """SingleTypeKVCacheManager.remove_skipped_blocks (+ MambaManager's align rule)."""
        tables = self.tables.get(rid)
        if tables is None:
            return
        for gi, g in enumerate(self.groups):
            t = tables[gi]
            skipped = self._skipped_tokens(g, n)
            if skipped > 0:
                nb = min(skipped // g.block_size, len(t))
                for i in range(nb - 1, -1, -1):
                    if t[i].is_null:
                        break
                    self.pool.free_blocks([t[i]])
                    t[i] = self.pool.null_block
            if g.kind == "mamba":
                last = self.last_state_idx.get(rid)
                if last is not None and last < cdiv(n, g.block_size) - 1 and not t[last].is_null:
                    self.pool.free_blocks([t[last]])
                    t[last] = self.pool.null_block

    def _plan(self, rid, total_computed, num_new, num_external, admission=False):
        """Blocks per group: (null pads, external blocks, new-token blocks).
        admission: the full-sequence check of a waiting request, with the
        sliding-window cap (SlidingWindowSpec.max_admission_blocks_per_request)."""
        tables = self.tables.get(rid) or [[] for _ in self.groups]
        plan = []
        for gi, g in enumerate(self.groups):
            t = tables[gi]
            pads = ext = new = 0
            bs = g.block_size
            length = len(t)
            if num_external > 0 and not t:
                skipped = self._skipped_tokens(g, total_computed)
                pads = max(0, skipped // bs)
                if total_computed - max(0, skipped) > 0:
                    ext = cdiv(total_computed, bs) - pads
                length = pads + ext
            need = cdiv(total_computed + num_new, bs)
            if admission and g.kind == "swa":
                need = min(need, cdiv(g.sliding_window - 1 + self.spec.max_num_batched_tokens, bs) + 1)
            if g.kind == "mamba":
                new = 1 if need > length else 0
            else:
                new = max(0, need - length)
            plan.append((pads, ext, new))
        return plan

    def allocate_slots(self, req, num_new, num_external=0, async_load=False, zero=None, waiting=False):
        """KVCacheManager.allocate_slots: returns the new-token blocks per group
        (KVCacheBlocks) or None when the pool is short. A waiting request is
        admitted only if its whole sequence fits (full_sequence_must_fit, the
        default scheduler_reserve_full_isl), an async load only beside the
        blocks in-flight prefills still need (reserved_blocks)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        rid = req.request_id
        total_computed = req.num_computed_tokens + num_external
        free = self.pool.get_num_free_blocks()
        if waiting:
            full = self._plan(rid, total_computed, max(req.num_tokens - total_computed, num_new), num_external,
                              admission=True)
            if sum(e + n for _, e, n in full) > free:
                return None
        self.remove_skipped_blocks(rid, req.num_computed_tokens)
        plan = self._plan(rid, total_computed, num_new, num_external)
        free = self.pool.get_num_free_blocks()
        if async_load:
            free -= sum(self._remaining_blocks(r) for r in self.inflight_prefills if r is not req)
        if sum(e + n for _, e, n in plan) > free:
            return None
        tables = self.tables.setdefault(rid, [[] for _ in self.groups])
        new_blocks = []
        for gi, g in enumerate(self.groups):
            pads, ext, new = plan[gi]
            t = tables[gi]
            if pads or ext:
                t.extend([self.pool.null_block] * pads)
                got = self.pool.get_new_blocks(ext)
                t.extend(got)
                if zero is not None and not async_load:
                    zero.extend(b.block_id for b in got)
            start = len(t)
            if new:
                if g.kind == "mamba":
                    if len(t) > 0:
                        self.last_state_idx[rid] = len(t) - 1
                    need = cdiv(total_computed + num_new, g.block_size)
                    t.extend([self.pool.null_block] * (need - 1 - len(t)))
                    got = self.pool.get_new_blocks(1)
                    self.allocated.add(rid)
                else:
                    got = self.pool.get_new_blocks(new)
                t.extend(got)
                if zero is not None:
                    zero.extend(b.block_id for b in got)
            new_blocks.append(t[start:])
        return KVCacheBlocks(tuple(new_blocks))

    def _remaining_blocks(self, req):
        """Scheduler._request_remaining_blocks: blocks req still needs for its
        whole sequence."""
        plan = self._plan(req.request_id, req.num_computed_tokens, req.num_tokens - req.num_computed_tokens, 0,
                          admission=True)
        return sum(e + n for _, e, n in plan)

    def get_blocks(self, rid):
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        return KVCacheBlocks(tuple(list(t) for t in self.tables.get(rid) or [[] for _ in self.groups]))

    def free_blocks(self, rid):
        tables = self.tables.pop(rid, None)
        if tables is not None:
            for t in tables:
                self.pool.free_blocks(list(reversed(t)))
        self.allocated.discard(rid)
        self.last_state_idx.pop(rid, None)

    def block_ids_for_computed(self, req):
        """get_block_ids_for_computed_tokens: attention groups clipped to the
        computed tokens, Mamba groups unclipped."""
        tables = self.tables.get(req.request_id) or [[] for _ in self.groups]
        out = []
        for gi, g in enumerate(self.groups):
            ids = [b.block_id for b in tables[gi]]
            if g.kind != "mamba":
                ids = ids[:cdiv(req.num_computed_tokens, g.block_size)]
            out.append(ids)
        return tuple(out)

    # -- scheduling

    def _mamba_split(self, req, num_new, num_external=0):
        """Scheduler._mamba_block_aligned_split (no EAGLE, no partial hits)."""
        if not self.mamba_bs:
            return num_new
        start = req.num_computed_tokens + num_external
        if start >= max(req.num_prompt_tokens, req.num_tokens - 1):
            return num_new
        bs = self.mamba_bs
        last_cache = req.num_tokens - req.num_tokens % bs
        end = start + num_new
        if end < last_cache:
            aligned = end // bs * bs
            if aligned > start or bs <= self.spec.max_num_batched_tokens:
                end = aligned
        stops = [last_cache]
        if start % bs and (start // bs + 1) * bs <= last_cache:
            stops.append((start // bs + 1) * bs)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _preempt(self, req, why):
        self.free_blocks(req.request_id)
        self.inflight_prefills.discard(req)
        req.status = self._status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        if req in self.running:
            self.running.remove(req)
        self.waiting.appendleft(req)
        self.preempted_ids.add(req.request_id)
        self.info[req.request_id]["preemptions"] += 1
        self.log.append((self.step, "preempt", req.request_id, why))

    def schedule(self, preempt_rules):
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.request import RequestStatus
        self._status = RequestStatus
        budget = self.spec.max_num_batched_tokens
        num_sched, new_blocks = {}, {}
        zero = [] if self.needs_zeroing else None
        preempted = False
        for rule in preempt_rules:
            req = self.requests.get(rule["req"])
            if rule.get("done") or req is None or req.status != RequestStatus.RUNNING:
                continue
            if ("step" in rule and self.phase_step >= rule["step"]) or \
                    ("computed" in rule and req.num_computed_tokens >= rule["computed"]):
                rule["done"] = True
                self._preempt(req, "forced by the test")
                preempted = True
        scheduled_running = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = self._mamba_split(req, n)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = self.allocate_slots(req, n, zero=zero)
                if blocks is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim, "out of blocks")
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled_running.append(req)
            num_sched[req.request_id] = n
            new_blocks[req.request_id] = blocks
            budget -= n
            i += 1
        scheduled_new, scheduled_resumed = [], []
        if not preempted:
            skipped = collections.deque()
            while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
                req = self.waiting.popleft()
                rid = req.request_id
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if rid not in self.finished_recving:
                        skipped.append(req)
                        continue
                    self._update_waiting_for_remote_kv(req)
                    req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
                ext, load_async = 0, False
                if req.num_computed_tokens == 0:
                    if self.connector is not None:
                        ext, load_async = self.connector.get_num_new_matched_tokens(req, 0)
                        if ext is None:
                            skipped.append(req)
                            continue
                        self._check_match(req, ext, load_async)
                        if ext > 0:
                            self.info[rid]["ext"].append((self.phase_step, ext, bool(load_async)))
                            self.hook("matched", req=rid, ext=ext, load_async=bool(load_async))
                        else:
                            load_async = False
                num_computed = req.num_computed_tokens + ext
                if load_async:
                    n = 0
                else:
                    n = req.num_tokens - num_computed
                    if n <= 0:
                        raise EngineError(
                            "get_num_new_matched_tokens(%s) answered (%d, False) for a request of %d tokens: "
                            "a synchronous hit must leave at least one token to compute (vLLM asserts "
                            "num_new_tokens > 0, scheduler.py B:L914)" % (rid, ext, req.num_tokens))
                    n = min(n, budget)
                    n = self._mamba_split(req, n, ext)
                    if n == 0:
                        skipped.append(req)
                        break
                blocks = self.allocate_slots(req, n, num_external=ext, async_load=load_async, zero=zero,
                                             waiting=True)
                if blocks is None:
                    skipped.append(req)
                    break
                if self.connector is not None:
                    self.connector.update_state_after_alloc(req, self.get_blocks(rid), ext)
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.num_computed_tokens = num_computed
                    self.inflight_prefills.add(req)
                    skipped.append(req)
                    continue
                self.running.append(req)
                if req.status == RequestStatus.PREEMPTED:
                    scheduled_resumed.append(req)
                else:
                    scheduled_new.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_computed
                num_sched[rid] = n
                new_blocks[rid] = blocks
                budget -= n
                if num_computed + n < req.num_tokens:
                    self.inflight_prefills.add(req)
            self.waiting.extendleft(reversed(skipped))
        # SchedulerOutput
        ids, resumed, new_tok, all_tok, nbids, ncomp, nout = [], set(), [], {}, [], [], []
        check = {}
        v2 = self.spec.runner == "v2"
        new_data = [NewRequestData.from_request(r, tuple([b.block_id for b in t] for t in self.tables[r.request_id]))
                    for r in scheduled_new]
        if v2:
            # the V2 model runner gets resumed requests as new ones (scheduler.py B:L1133)
            new_data += [NewRequestData.from_request(r, tuple([b.block_id for b in t]
                                                              for t in self.tables[r.request_id]),
                                                     prefill_token_ids=list(r.all_token_ids))
                         for r in scheduled_resumed]
            for r in scheduled_resumed:
                self.tokens_sent[r.request_id] = r.num_tokens
                if r.num_computed_tokens > 0:
                    check[r.request_id] = r.num_computed_tokens
            scheduled_resumed = []
        for r in scheduled_new:
            self.tokens_sent[r.request_id] = r.num_prompt_tokens
            if r.num_computed_tokens > 0:
                check[r.request_id] = r.num_computed_tokens
        for r in scheduled_running + scheduled_resumed:
            rid = r.request_id
            ids.append(rid)
            if r in scheduled_resumed:
                resumed.add(rid)
                nbids.append(tuple([b.block_id for b in t] for t in self.tables[rid]))
                all_tok[rid] = list(r.all_token_ids)
                new_tok.append([])
                if r.num_computed_tokens > 0:
                    check[rid] = r.num_computed_tokens
            else:
                nbids.append(new_blocks[rid].get_block_ids(allow_none=True))
                if rid not in self.scheduled_before:
                    all_tok[rid] = list(r.all_token_ids)
                new_tok.append(list(r.all_token_ids[self.tokens_sent.get(rid, r.num_prompt_tokens):]))
            self.tokens_sent[rid] = r.num_tokens
            ncomp.append(r.num_computed_tokens)
            nout.append(r.num_output_tokens)
        so = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=CachedRequestData(ids, resumed, new_tok, all_tok, nbids, ncomp, nout),
            num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0] * len(self.groups), finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[], preempted_req_ids=self.preempted_ids,
            new_block_ids_to_zero=sorted(set(zero)) if zero else None)
        if self.connector is not None:
            before = pickle.dumps(so)
            meta = self.connector.build_connector_meta(so)
            if pickle.dumps(so) != before:
                raise EngineError("build_connector_meta modified the SchedulerOutput (base.py: it should NOT "
                                  "modify fields in the scheduler_output)")
            so.kv_connector_metadata = meta
        # _update_after_schedule
        for rid, n in num_sched.items():
            r = self.requests[rid]
            r.num_computed_tokens += n
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens
            if not r.is_prefill_chunk:
                self.inflight_prefills.discard(r)
        self.scheduled_before = set(num_sched)
        self.finished_req_ids = set()
        self.preempted_ids = set()
        for rid in check:
            self.info[rid]["load_checks"] += 1
        return so, {"check": check}

    def _check_match(self, req, ext, load_async):
        if not isinstance(ext, int) or ext < 0:
            raise EngineError("get_num_new_matched_tokens(%s) answered %r" % (req.request_id, (ext, load_async)))
        if ext == 0 and load_async:
            raise EngineError("get_num_new_matched_tokens(%s) answered (0, True): the flag must be False "
                              "when no token is matched (base.py docstring)" % req.request_id)
        if ext > req.num_tokens:
            raise EngineError("get_num_new_matched_tokens(%s) answered %d tokens for a request of %d "
                              "(vLLM asserts num_computed_tokens <= num_tokens)" % (req.request_id, ext,
                                                                                 req.num_tokens))

    def _update_waiting_for_remote_kv(self, req):
        """Scheduler._update_waiting_for_remote_kv (B:L2635)."""
        rid = req.request_id
        if rid in self.failed_recving:
            if req.num_computed_tokens == 0:
                self.free_blocks(rid)
            self.failed_recving.discard(rid)
        elif req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
            self.log.append((self.step, "full-hit-recompute-last", rid, ""))
        self.finished_recving.discard(rid)

    # -- outputs

    def update_from_output(self, so, outs):
        from vllm.v1.request import RequestStatus
        for o in outs:
            for name, (n, mx) in o.get("timing", {}).items():
                c, m = self.timing["workers"].get(name, (0, 0.0))
                self.timing["workers"][name] = (c + n, max(m, mx))
        kv = self.agg.aggregate([o["kv"] for o in outs]) if self.connector is not None else None
        failed = set()
        if kv is not None and kv.failed_recving:
            self._handle_failed_recving(kv.failed_recving)
        if kv is not None and kv.invalid_block_ids:
            self.log.append((self.step, "invalid_block_ids", None, sorted(kv.invalid_block_ids)))
            failed = self._handle_invalid_blocks(kv.invalid_block_ids, so.num_scheduled_tokens)
        # byte checks of loaded prefixes: a mismatch on a block the connector
        # reported (this step or earlier) is a handled load error
        for o in outs:
            for c in o["checks"]:
                if c["block"] in self.bad_blocks[c["rid"]] or c.get("read_block") in self.bad_blocks[c["rid"]]:
                    continue
                c["step"] = self.phase_step
                self.checks.append(c)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or rid in failed or req.status != RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens < req.num_tokens:
                continue
            digs = [o["digests"].get(rid) for o in outs]
            if any(d is None for d in digs):
                raise EngineError("no output digest for %s from some rank" % rid)
            req.append_output_token_ids(MockModel.combine(digs, self.spec.vocab))
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free_request(req)
        if kv is not None:
            self._update_from_kv_xfer_finished(kv)
            st = kv.kv_connector_stats
            sst = self.connector.get_kv_connector_stats()
            if sst is not None and not sst.is_empty():
                st = sst if st is None else st.aggregate(sst)
            if st is not None:
                self.stats = st if self.stats is None else self.stats.aggregate(st)
            list(self.connector.take_events())

    def finish_requests(self, ids):
        """Scheduler.finish_requests(ids, FINISHED_ABORTED) (B:L2237): a request
        still loading asynchronously keeps its blocks until its finished_recving."""
        from vllm.v1.request import RequestStatus
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
            delay = False
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay = rid not in self.finished_recving
                self.finished_recving.discard(rid)
                self.failed_recving.discard(rid)
            req.status = RequestStatus.FINISHED_ABORTED
            self.log.append((self.step, "abort", rid, "blocks held for its load" if delay else ""))
            self._free_request(req, delay_free_blocks=delay)

    def _free_request(self, req, delay_free_blocks=False):
        """Scheduler._free_request / _connector_finished (B:L2577)."""
        rid = req.request_id
        if req in self.running:
            self.running.remove(req)
        self.inflight_prefills.discard(req)
        delay = False
        if self.connector is not None:
            self.remove_skipped_blocks(rid, req.num_computed_tokens)
            ids = self.block_ids_for_computed(req)
            if self.hma:
                res = self.connector.request_finished_all_groups(req, ids)
            else:
                if len(ids) != 1:
                    raise EngineError("a connector without SupportsHMA with %d KV-cache groups" % len(ids))
                res = self.connector.request_finished(req, ids[0])
            if not (isinstance(res, tuple) and len(res) == 2):
                raise EngineError("request_finished%s(%s) returned %r, not (bool, params)"
                                  % ("_all_groups" if self.hma else "", rid, res))
            delay = bool(res[0])
        self.finished_req_ids.add(rid)
        self.info[rid]["finish_step"] = self.phase_step
        self.info[rid]["delayed_free"] = delay
        self.hook("finished", req=rid)
        if not (delay or delay_free_blocks):
            self._free_blocks(req)

    def _free_blocks(self, req):
        self.free_blocks(req.request_id)
        del self.requests[req.request_id]
        self.info[req.request_id]["freed_step"] = self.phase_step
        self.hook("freed", req=req.request_id)

    def _update_from_kv_xfer_finished(self, kv):
        self.connector.update_connector_output(kv)
        for rid in kv.finished_recving or ():
            req = self.requests.get(rid)
            if req is None:
                raise EngineError("finished_recving names %s, which the scheduler does not hold (vLLM asserts "
                                  "req_id in self.requests, scheduler.py _update_from_kv_xfer_finished)" % rid)
            if req.status == self._status.WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
            elif req.is_finished():
                self._free_blocks(req)
            else:
                raise EngineError("finished_recving names %s in state %s: vLLM asserts the request is "
                                  "WAITING_FOR_REMOTE_KVS or finished (_update_from_kv_xfer_finished)"
                                  % (rid, req.status))
        for rid in kv.finished_sending or ():
            req = self.requests.get(rid)
            if req is None:
                raise EngineError("finished_sending names %s, which the scheduler does not hold: vLLM asserts "
                                  "req_id in self.requests (only ids whose request_finished returned True "
                                  "may be reported, once)" % rid)
            if not req.is_finished() or not self.info[rid].get("delayed_free"):
                raise EngineError("finished_sending names %s (%s), whose free was not delayed by "
                                  "request_finished; vLLM would free its blocks under it" % (rid, req.status))
            self._free_blocks(req)

    def _handle_failed_recving(self, failed):
        """Scheduler._handle_failed_recving (vLLM 0.32): an asynchronous load
        reported failed restarts from 0 under "recompute"."""
        from vllm.v1.request import RequestStatus
        if not self.recompute_failures:
            raise EngineError("failed loads under kv_load_failure_policy 'fail': %s" % sorted(failed))
        for rid in failed:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.info[rid]["recomputes"].append((self.phase_step, req.num_computed_tokens, 0, []))
                self.log.append((self.step, "load-failed", rid, "computed %d -> 0" % req.num_computed_tokens))
                req.num_computed_tokens = 0
                self.failed_recving.add(rid)

    def _handle_invalid_blocks(self, invalid, num_scheduled):
        """Scheduler._handle_invalid_blocks + _update_requests_with_invalid_blocks
        (vLLM 0.32), "recompute" policy: the request restarts from its first
        bad block. With several KV-cache groups vLLM raises (block ids are per
        group): so does this engine, a negative control for connectors."""
        from vllm.v1.request import RequestStatus
        if len(self.groups) > 1:
            raise EngineError("A KV connector reported block-level load failures (invalid_block_ids) "
                              "with %d KV cache groups (vLLM 0.32 raises RuntimeError)" % len(self.groups))
        if not self.recompute_failures:
            raise EngineError("KV load errors under kv_load_failure_policy 'fail': %s" % sorted(invalid))
        sync_failed = set()
        async_reqs = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        for reqs, is_async in ((async_reqs, True), (list(self.running), False)):
            for req in reqs:
                rid = req.request_id
                tables = self.tables.get(rid)
                if tables is None:
                    continue
                done = req.num_computed_tokens - num_scheduled.get(rid, 0)
                t = None
                mine = set()
                for gi, g in enumerate(self.groups):
                    ids = [b.block_id for b in tables[gi]]
                    for idx in range(min(cdiv(done, g.block_size), len(ids))):
                        if ids[idx] in invalid and ids[idx] != NULL:
                            mine.add(ids[idx])
                            tg = idx * g.block_size
                            t = tg if t is None else min(t, tg)
                            break
                if t is None:
                    continue
                self.bad_blocks[rid] |= mine
                t = self._servable(rid, t, invalid)
                self.info[rid]["recomputes"].append((self.phase_step, done, t, sorted(mine)))
                self.log.append((self.step, "load-error", rid, "computed %d -> %d" % (done, t)))
                if is_async:
                    req.num_computed_tokens = t
                    self.failed_recving.add(rid)
                else:
                    sync_failed.add(rid)
                    req.num_computed_tokens = t
        return sync_failed

    def _servable(self, rid, t, invalid):
        tables = self.tables[rid]
        for gi, g in enumerate(self.groups):
            ids = [b.block_id for b in tables[gi]]
            if g.kind == "swa" and t > 0:
                lo = max(0, t - g.sliding_window + 1)
                for idx in range(lo // g.block_size, cdiv(t, g.block_size)):
                    if idx >= len(ids) or ids[idx] == NULL or ids[idx] in invalid:
                        return 0
            if g.kind == "mamba" and t > 0:
                idx = t // g.block_size - 1
                if t % g.block_size or idx >= len(ids) or ids[idx] == NULL or ids[idx] in invalid:
                    return 0
        return t

    # -- the engine loop (EngineCore.step)

    def has_requests(self):
        return bool(self.requests) or (self.connector is not None and self.connector.has_pending_push_work())

    def execute(self, so, extra):
        for c in self.workers:
            c.send(("step", so, extra))
        outs = []
        for r, c in enumerate(self.workers):
            if not c.poll(self.step_timeout):
                raise EngineError("rank %d did not finish step %d within %.0f s (stacks in its log)"
                                  % (r, self.step, self.step_timeout))
            msg = c.recv()
            if msg[0] != "ok":
                raise EngineError(msg[1])
            outs.append(msg[1])
        return outs

    def run_phase(self, requests, preempt_rules, max_steps=4000):
        pending = sorted(requests, key=lambda r: r.get("arrive", 0))
        self.phase_step = 0
        ids = [r["id"] for r in requests]
        while True:
            while pending and pending[0].get("arrive", 0) <= self.phase_step and \
                    all(a in self.info and a not in self.requests for a in pending[0].get("after", ())):
                self.add_request(pending.pop(0))
            if not self.has_requests():
                if not pending:
                    break
                self.phase_step += 1
                continue
            if self.phase_step >= max_steps:
                raise EngineError("phase did not end within %d steps: %s" % (max_steps, self._describe()))
            self.hook("step", step=self.phase_step)
            if self.pending_aborts:
                ids, self.pending_aborts = self.pending_aborts, []
                self.finish_requests(ids)
            so, extra = self.schedule(preempt_rules)
            outs = self.execute(so, extra)
            self.update_from_output(so, outs)
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)
            self.step += 1
            self.phase_step += 1
        res = {"tokens": {}, "info": {}, "steps": self.phase_step}
        for rid in ids:
            res["info"][rid] = self.info[rid]
        return res

    def _describe(self):
        return "; ".join("%s %s computed %d/%d" % (r.request_id, r.status, r.num_computed_tokens, r.num_tokens)
                         for r in self.requests.values())


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def scheduler_main(ctrl, worker_conns, spec, connector, extra_config, engine_id, log_path, step_timeout):
    _setup_process(log_path)
    try:
        for c in worker_conns:
            if not c.poll(120):
                raise EngineError("a worker did not start within 120 s")
            msg = c.recv()
            if msg[0] != "ready":
                raise EngineError(msg[1])

        triggers = []

        def hook(event, **info):
            for i, t in enumerate(triggers):
                if t.get("_fired") or t["on"] != event:
                    continue
                if any(info.get(k) != v for k, v in t.items() if k not in ("on", "id")):
                    continue
                t["_fired"] = True
                ctrl.send(("hook", t.get("id", i), dict(info, event=event)))
                msg = ctrl.recv()
                if msg[0] != "ack":
                    raise EngineError("control: %r" % (msg,))
                if msg[1]:
                    s.pending_aborts.extend(msg[1].get("abort", ()))

        s = Scheduler(spec, connector, extra_config, engine_id, worker_conns, hook, step_timeout)
        ctrl.send(("ready", None))
    except BaseException:
        ctrl.send(("error", "scheduler init:\n%s" % traceback.format_exc()))
        return
    while True:
        try:
            msg = ctrl.recv()
        except EOFError:
            return
        try:
            if msg[0] == "run":
                triggers[:] = msg[3]
                res = s.run_phase(msg[1], msg[2])
                res["tokens"] = {r["id"]: _outputs_of(s, r["id"]) for r in msg[1]}
                res["checks"] = list(s.checks)
                res["log"] = list(s.log)
                res["stats"] = dict(s.stats.data) if s.stats is not None else {}
                res["timing"] = {k: dict(v) for k, v in s.timing.items()}
                s.stats = None
                for v in s.timing.values():
                    v.clear()
                s.checks.clear()
                s.log.clear()
                ctrl.send(("done", res))
            elif msg[0] == "shutdown":
                errs = []
                for c in worker_conns:
                    c.send(("shutdown",))
                for r, c in enumerate(worker_conns):
                    if c.poll(30):
                        m = c.recv()
                        if m[0] != "bye":
                            errs.append(m[1])
                    else:
                        errs.append("rank %d did not shut down within 30 s" % r)
                if s.connector is not None:
                    s.connector.shutdown()
                ctrl.send(("bye", errs))
                return
        except BaseException:
            ctrl.send(("error", traceback.format_exc()))


def _outputs_of(s, rid):
    return list(s.outputs[rid]) if rid in s.outputs else None


# ---------------------------------------------------------------------------------------------
# the test side


class EngineFailure(AssertionError):
    """The engine raised, hung or broke a vLLM contract; the message carries
    the traceback and the processes' log tails."""


class EngineHandle:
    """Starts the scheduler process and one process per TP rank (spawned:
    fresh interpreters, as vLLM's workers), runs phases of requests and
    answers the scheduler's hooks in this process. Everything is bounded:
    a phase that does not end within ``timeout`` seconds dumps every
    process's stacks into its log and fails."""

    def __init__(self, spec, connector=None, extra_config=None, engine_id="engine-0", log_dir=None,
                 start_timeout=120, step_timeout=60):
        import multiprocessing as mp
        import tempfile
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvt-vllm-")
        self.logs = []
        self.procs = []
        self.closed = False
        wconns = []
        for r in range(spec.tp):
            a, b = ctx.Pipe()
            log = os.path.join(self.log_dir, "%s-rank%d.log" % (engine_id, r))
            self.logs.append(log)
            p = ctx.Process(target=worker_main, args=(b, r, spec, connector, extra_config, engine_id, log),
                            name="%s-rank%d" % (engine_id, r))
            p.start()
            b.close()
            self.procs.append(p)
            wconns.append(a)
        self.ctrl, theirs = ctx.Pipe()
        log = os.path.join(self.log_dir, "%s-scheduler.log" % engine_id)
        self.logs.append(log)
        p = ctx.Process(target=scheduler_main, args=(theirs, wconns, spec, connector, extra_config, engine_id,
                                                     log, step_timeout), name="%s-scheduler" % engine_id)
        p.start()
        theirs.close()
        for c in wconns:
            c.close()
        self.procs.append(p)
        self._expect("ready", start_timeout)

    def _expect(self, what, timeout, hooks=None):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.ctrl.poll(left):
                self._fail("no '%s' from the scheduler within %.0f s (a hang: stacks below)" % (what, timeout),
                           dump=True)
            try:
                msg = self.ctrl.recv()
            except EOFError:
                self._fail("the scheduler process died (exit %s)" % self.procs[-1].exitcode)
            if msg[0] == "hook":
                fn = (hooks or {}).get(msg[1])
                ret = None
                try:
                    if fn is not None:
                        ret = fn(msg[2])
                finally:
                    self.ctrl.send(("ack", ret if isinstance(ret, dict) else None))
                continue
            if msg[0] == "error":
                self._fail("engine error:\n" + msg[1])
            if msg[0] != what:
                self._fail("unexpected %r" % (msg[0],))
            return msg[1]

    def run(self, requests, hooks=None, triggers=(), preempt=(), timeout=60):
        """Runs requests until every one has finished and been freed.
        requests: dicts id, prompt, max_tokens, optional arrive (phase step)
        and after (ids that must be freed first). triggers: dicts with "id"
        (the key into hooks), "on" ("step", "matched", "finished", "freed")
        and values to match ("step", "req"); each fires once and the engine
        waits for its hook. preempt: dicts "req" plus "step" or "computed"."""
        if self.closed:
            raise EngineFailure("engine closed")
        self.ctrl.send(("run", [dict(r) for r in requests], [dict(p) for p in preempt],
                        [dict(t) for t in triggers]))
        return self._expect("done", timeout, hooks)

    def close(self, timeout=40):
        if self.closed:
            return []
        self.closed = True
        errs = []
        try:
            if self.procs[-1].is_alive():
                self.ctrl.send(("shutdown",))
                errs = self._expect("bye", timeout) or []
        finally:
            self._reap()
        return errs

    def _reap(self):
        for p in self.procs:
            p.join(5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def log_tail(self, n=40):
        out = []
        for log in self.logs:
            try:
                with open(log, errors="replace") as f:
                    lines = f.readlines()
            except OSError:
                continue
            if lines:
                out.append("---- %s (last %d lines)\n%s" % (os.path.basename(log), min(n, len(lines)),
                                                           "".join(lines[-n:])))
        return "\n".join(out)

    def _fail(self, msg, dump=False):
        self.closed = True
        if dump:
            for p in self.procs:
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGUSR1)
                    except OSError:
                        pass
            time.sleep(1.0)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._reap()
        raise EngineFailure("%s\n%s" % (msg, self.log_tail()))
