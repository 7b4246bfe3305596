"""Mirrors KVCacheBlocks of vllm/v1/core/kv_cache_manager.py (vllm-project/vllm @
003df2961dd8830c317a61f9745ccd557da9fa06; B:L33): the blocks of a request,
one sequence per KV-cache group (``blocks[group][i]``), null blocks (id 0)
included. ``update_state_after_alloc`` receives all blocks of the request
in every group."""

from dataclasses import dataclass


@dataclass
class KVCacheBlocks:
    blocks: tuple

    def __add__(self, other):
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none=False):
        if allow_none and all(len(g) == 0 for g in self.blocks):
            return None
        return tuple([b.block_id for b in g] for g in self.blocks)

    def get_unhashed_block_ids(self):
        assert len(self.blocks) == 1, "Only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self):
        return [[b.block_id for b in g if b.block_hash is None and not b.is_null] for g in self.blocks]

    def new_empty(self):
        return KVCacheBlocks(tuple(() for _ in self.blocks))
