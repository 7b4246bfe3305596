"""Mirrors the block hashing of vllm/v1/core/kv_cache_utils.py (vllm-project/vllm @
e578de311c2416e66c6a8b9819586bb91de10f9d: NONE_HASH / init_none_hash B:L95,
hash_block_tokens B:L576, generate_block_hash_extra_keys B:L538 (cache_salt
only; no LoRA, multimodal or prompt embeds here), get_request_block_hasher
B:L671) and KVCacheBlock (B:L118).

A block hash is ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``
over each full ``hash_block_size``-token block, chained. NONE_HASH is
``hash_fn(PYTHONHASHSEED)`` when that is set, else random per process, as
in vLLM; the stand-in always seeds it (``init_none_hash`` with the seed
"0" unless PYTHONHASHSEED says otherwise), so hashes agree across the
scheduler processes of different engines."""

import os
from dataclasses import dataclass

from vllm.utils.hashing import sha256

NONE_HASH = None


def init_none_hash(hash_fn, seed=None):
    global NONE_HASH
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or "0"
    NONE_HASH = hash_fn(seed)


init_none_hash(sha256)


def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return hash_function((parent, tuple(curr_block_token_ids), extra_keys))


def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx):
    keys = [request.cache_salt] if (start_token_idx == 0 and request.cache_salt) else []
    return tuple(keys) if keys else None


def get_request_block_hasher(hash_block_size, caching_hash_fn=sha256):
    """A function giving the hashes of the request's full blocks not hashed yet."""

    def request_block_hasher(request):
        start = len(request.block_hashes) * hash_block_size
        prev = request.block_hashes[-1] if request.block_hashes else None
        out = []
        while start + hash_block_size <= request.num_tokens:
            end = start + hash_block_size
            extra = generate_block_hash_extra_keys(request, start, end)
            prev = hash_block_tokens(caching_hash_fn, prev, request.all_token_ids[start:end], extra)
            out.append(prev)
            start = end
        return out

    return request_block_hasher


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    is_null: bool = False
