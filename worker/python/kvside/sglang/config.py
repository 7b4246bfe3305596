"""kvside.sglang.config: the backend's keys of SGLang's
--hicache-storage-backend-extra-config (docs/sglang.md, "Settings")."""

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from kvside import settings as _settings

# keys SGLang itself reads from --hicache-storage-backend-extra-config
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size")
MAX_KEYS = 4096          # protocol.md 2.3: keys per request
_LRU = 65536             # occurrence counters kept (as many as the server's terminal table)


# ---- configuration ------------------------------------------------------------------------

@dataclass
class StorageConfig:
    broker_dir: Optional[str] = None          # kvside-server's fd-broker directory (None: its default)
    endpoint: Optional[str] = None            # ZeroMQ endpoint (None: ipc://<broker_dir>/kvside.zmq)
    namespace: Optional[str] = None           # the whole namespace (None: derived, see namespace_of)
    namespace_salt: str = ""        # mixed into the derived namespace (tenant isolation)
    timeout_ms: int = 10000         # default request timeout (also opening the session)
    lookup_timeout_ms: int = 2000   # batch_exists; a late answer counts as no hit
    load_timeout_ms: int = 30000    # batch_get_v1: one retrieve
    store_wait_ms: int = 65000      # batch_set_v1: longest wait for the job to end on all ranks
    pin_ms: int = 10000             # a hit stays pinned in L1 this long (until its get)
    prefetch: bool = True           # batch_exists starts promoting L2 hits into L1

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "StorageConfig":
        extra = dict(extra or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                "kvside: SGLang must call the zero-copy interface (batch_get_v1/batch_set_v1): add "
                "\"interface_v1\": 1 to --hicache-storage-backend-extra-config")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known) - set(SGLANG_KEYS))
        if unknown:
            raise ValueError("kvside: unknown --hicache-storage-backend-extra-config key(s) %s; kvside's "
                             "keys: %s; SGLang's: %s" % (", ".join(unknown), ", ".join(sorted(known)),
                                                         ", ".join(SGLANG_KEYS)))
        cfg = cls()
        _settings.assign(cfg, known, extra.items())
        for k in ("timeout_ms", "lookup_timeout_ms", "load_timeout_ms", "store_wait_ms"):
            if getattr(cfg, k) <= 0:
                raise ValueError("kvside: %s must be positive" % k)
        if cfg.pin_ms > 600000:
            raise ValueError("kvside: pin_ms must be at most 600000")
        if cfg.namespace is not None and not 0 < len(cfg.namespace.encode()) <= 128:
            raise ValueError("kvside: namespace must be 1..128 bytes")
        return cfg
