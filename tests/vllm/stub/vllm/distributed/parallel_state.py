"""Mirrors vllm/distributed/parallel_state.py (vllm-project/vllm @
e578de311c2416e66c6a8b9819586bb91de10f9d): ``get_tensor_model_parallel_rank``
and ``get_tensor_model_parallel_world_size`` (in vLLM: the TP group's
rank_in_group / world_size), plus ``get_tp_group`` with those two fields.
There is no process group here: the driver sets them with
``set_tensor_model_parallel`` (not a vLLM function) in each worker process;
like vLLM, asking before they are set fails."""

from dataclasses import dataclass


@dataclass
class _GroupCoordinator:
    rank_in_group: int
    world_size: int


_TP = None


def set_tensor_model_parallel(rank, world_size):
    """Driver hook (not in vLLM): this process is TP rank ``rank`` of ``world_size``."""
    global _TP
    if not 0 <= rank < world_size:
        raise ValueError("rank %d outside world %d" % (rank, world_size))
    _TP = _GroupCoordinator(rank, world_size)


def get_tp_group():
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


def get_tensor_model_parallel_world_size():
    return get_tp_group().world_size


def get_tensor_model_parallel_rank():
    return get_tp_group().rank_in_group
