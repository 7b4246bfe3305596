"""Mirrors vllm/forward_context.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d),
minimally: ForwardContext (no_compile_layers, attn_metadata, slot_mapping,
virtual_engine), get_forward_context / is_forward_context_available and the
set_forward_context context manager. ``attn_metadata`` is None on the
no-forward path (kv_connector_no_forward), else {layer name: metadata}."""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_forward_context = None


@dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    slot_mapping: dict[str, Any] = field(default_factory=dict)
    virtual_engine: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)


def get_forward_context():
    assert _forward_context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward context.")
    return _forward_context


def is_forward_context_available():
    return _forward_context is not None


def create_forward_context(attn_metadata, vllm_config, slot_mapping=None, no_compile_layers=None):
    return ForwardContext(no_compile_layers=no_compile_layers or {}, attn_metadata=attn_metadata,
                          slot_mapping=slot_mapping or {})


@contextmanager
def set_forward_context(attn_metadata, vllm_config, slot_mapping=None, no_compile_layers=None):
    global _forward_context
    prev = _forward_context
    _forward_context = create_forward_context(attn_metadata, vllm_config, slot_mapping,
                                              no_compile_layers)
    try:
        yield
    finally:
        _forward_context = prev
