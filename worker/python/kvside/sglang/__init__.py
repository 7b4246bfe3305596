"""kvside.sglang: an L3 storage backend for SGLang's hierarchical cache
(HiCache), loaded through SGLang's ``dynamic`` storage backend (docs/sglang.md).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvside",
        "module_path": "kvside.sglang", "class_name": "KvsideStorage",
        "interface_v1": 1, "allocator": "shm", "broker_dir": "/run/kvside"}'

Checked against sglang 0.5.23 from PyPI (tests/sglang_pkg) and, for what
that release is not run with here, sgl-project/sglang at 001067ff
(tests/sglang/stub). Importing it needs SGLang (the HiCacheStorage base
class).

Modules, one concept each: config (the extra-config keys), pools (a host
pool as kvside views, the namespace, page keys), storage (KvsideStorage:
registration, the v1 interface, jobs), hybrid (the v2 interface).

How it maps (each decision is explained in docs/sglang.md):
- one kvside chunk = one SGLang page; its key is SGLang's page hash (which
  already chains the whole prefix) hashed with the namespace;
- the rank's host pool is registered ONCE (every page of every layer, K and
  V, as kvside layer views derived from ``get_page_buffer_meta``), so gets and
  sets are zero-copy between the pool and the server;
- hybrid models (SGLang's v2 interface: register_mem_host_pool_v2,
  batch_exists_v2 / batch_get_v2 / batch_set_v2 with PoolTransfers): every
  side pool is a registration of its own (own session and namespace): the
  Mamba state pool a kvside recurrent group (a slot = the state at the end of
  one page), SWA / indexer / draft pools full-attention groups of their
  pages; batch_exists_v2 answers the longest prefix that KV and every pool's
  hit policy allow at once; DeepSeek V4's pools and logical anchors are
  refused;
- TP ranks are kvside ranks (world = TP size) for MHA pools: a page set is
  one kvside job spanning all TP ranks, committed only when every rank's part
  is in; MLA pools are identical on every rank, so each rank is a world of
  one and only TP rank 0 stores (SGLang's own rule);
- job ids are derived, not exchanged: every rank computes the same id from
  the engine name (agreed once through torch.distributed), the operation, the
  keys and a per-key-list occurrence counter.
"""

from .config import StorageConfig
from .pools import namespace_of, page_key, pool_views
from .storage import KvsideStorage

__all__ = ["KvsideStorage", "StorageConfig", "namespace_of", "page_key", "pool_views"]
