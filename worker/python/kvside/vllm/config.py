"""The connector's settings: ``kv_connector_extra_config`` of vLLM's
``--kv-transfer-config``, checked once, with clear errors (docs/vllm.md)."""

import hashlib
from dataclasses import dataclass, fields
from typing import Optional

from ..settings import assign

STORE_POLICIES = ("eager", "finished", "none")


@dataclass
class ConnectorConfig:
    broker_dir: Optional[str] = None          # kvside-server's fd-broker directory (None: its default)
    endpoint: Optional[str] = None            # ZeroMQ endpoint (None: ipc://<broker_dir>/kvside.zmq)
    chunk_tokens: int = 256         # tokens per kvside chunk (a multiple of every block size)
    namespace: Optional[str] = None           # the whole namespace (None: derived, see namespace_of)
    namespace_salt: str = ""        # mixed into the derived namespace (tenant isolation)
    timeout_ms: int = 10000         # default request timeout
    open_timeout_ms: int = 2000     # connecting to the server (the scheduler retries later)
    reconnect_ms: int = 5000        # scheduler: how long to answer "no hit" before retrying to connect
    lookup_timeout_ms: int = 2000   # one lookup (a late answer counts as no hit)
    lookup_wait_ms: int = 1         # longest the EngineCore loop waits for a lookup (then: asked again)
    load_timeout_ms: int = 30000    # one load; past it failed, reported once its job ended (docs/vllm.md)
    late_load_gone_ms: int = 5000   # a load past its time-out: the server answering nothing this long is gone
    save_wait_ms: int = 60000       # longest wait for a save whose blocks are about to be reused
    pin_ms: int = 10000             # a lookup's hit stays pinned in L1 this long (until its load)
    store: str = "eager"            # eager | finished | none
    load: bool = True               # look up and load (also needs a kv_role that consumes)
    hash_block_size: int = 0        # tokens per vLLM block hash (0: as vLLM derives it)
    kv_layout: str = "NHD"          # the KV-cache layout the connector asks vLLM for (NHD or HND)

    @classmethod
    def from_extra(cls, extra):
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError("kvside: unknown kv_connector_extra_config key(s) %s; known: %s"
                             % (", ".join(unknown), ", ".join(sorted(known))))
        cfg = cls()
        assign(cfg, known, extra.items())
        if cfg.chunk_tokens <= 0:
            raise ValueError("kvside: chunk_tokens must be positive")
        if cfg.kv_layout not in ("NHD", "HND"):
            raise ValueError("kvside: kv_layout must be NHD or HND, not %r" % cfg.kv_layout)
        if cfg.store not in STORE_POLICIES:
            raise ValueError("kvside: store must be one of %s, not %r" % (", ".join(STORE_POLICIES), cfg.store))
        return cfg


def namespace_of(cfg, model, dtype, tp, block_sizes, hash_algo, layout):
    """The kvside namespace of an engine: everything that makes two engines'
    bytes for one prompt differ (model, cache dtype, TP size, cache layout,
    block sizes, chunk size, block-hash algorithm), plus the salt. Geometry
    differences the server sees (head sizes, layer counts) are also caught by
    its per-group fingerprints (protocol.md 14.2); NHD and HND pages have the
    same size, so the layout must be in the name."""
    if cfg.namespace:
        return cfg.namespace
    return "vllm|%s|%s|tp%d|%s|bs%s|c%d|%s|%s" % (model, dtype, tp, layout,
                                                 ",".join(str(b) for b in block_sizes), cfg.chunk_tokens,
                                                 hash_algo, cfg.namespace_salt)


def chunk_key(ns_digest, block_hash):
    """The 32-byte kvside key of the chunk ending with this vLLM block hash.
    vLLM's block hashes are chained (each covers its parent's), so the hash
    of a chunk's last block names the whole prefix up to the chunk's end,
    including what vLLM mixes in (multimodal hashes, LoRA, cache_salt)."""
    return hashlib.blake2b(bytes(block_hash), digest_size=32, key=ns_digest).digest()


def ns_digest(namespace):
    return hashlib.blake2b(namespace.encode(), digest_size=32, person=b"kvside-vllm").digest()
