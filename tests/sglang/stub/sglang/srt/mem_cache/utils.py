"""Mirrors get_hash_str of python/sglang/srt/mem_cache/utils.py as
managers/cache_controller.py (sgl-project/sglang @
001067fffe33427bee0ed2f007fb7551a1d76b44) calls it:
``get_hash_str(token_ids, prior_hash, page_size=...)`` -> one hex string per
full page, each a SHA-256 chained over the previous page's hash and the
page's token ids (4 bytes little-endian each), as get_hash_str of
hicache_storage.py @ bb424de23a4659f89cfd97dcad3aa1935a1e1d3e hashes one page.
"""

import hashlib


def get_hash_str(token_ids, prior_hash=None, page_size=1):
    out = []
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        hasher = hashlib.sha256()
        if prior_hash:
            hasher.update(bytes.fromhex(prior_hash))
        for t in token_ids[start:start + page_size]:
            hasher.update(int(t).to_bytes(4, byteorder="little", signed=False))
        prior_hash = hasher.hexdigest()
        out.append(prior_hash)
    return out
