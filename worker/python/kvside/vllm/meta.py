"""What the scheduler-side connector tells the workers each step
(KvsideConnectorMetadata, pickled by vLLM with the SchedulerOutput)."""

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class JobOp:
    """One kvside job every rank runs with the same keys and block lists.

    blocks: one array('q') of block ids per KV-cache group (kvside shape).
    For a load, skip_tokens are tokens the engine already holds, and
    ``sync`` says the step waits for it (else it is reported through
    get_finished). ``volatile``: the store reads blocks vLLM may free while
    the request runs (sliding-window or Mamba groups), so the next step
    fences it before its forward."""
    req_id: str
    job: int
    keys: bytes
    blocks: list
    skip_tokens: int = 0
    sync: bool = False
    volatile: bool = False
    at_step_start: bool = False
    names: Optional[bytes] = None   # store: vLLM's block hash of each chunk's last block (KV events)


@dataclass
class KvsideConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)        # JobOp, run in start_load_kv
    stores: list = field(default_factory=list)       # JobOp, run in wait_for_save (or start_load_kv)
    preempted: set = field(default_factory=set)      # their stores end before the step writes KV
    finish_pending: set = field(default_factory=set)  # report in finished_sending once their stores end
