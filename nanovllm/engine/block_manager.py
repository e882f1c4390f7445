from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # chained hash of the full block's tokens and all blocks before it; -1: not cached
        self.token_ids: list[int] = []

    def reset(self):
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """Chained xxhash: equal hashes mean equal blocks *and* equal prefixes (up to collisions)."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    """Paged KV blocks with reference counts and a prefix cache of full blocks.

    A block enters the prefix cache only once its K/V have been computed (`hash_blocks`), so a
    half-done chunked prefill is never served to another request. Freed blocks keep their hash and
    can be revived until they are handed out for new content: never-used blocks first (in id order),
    then the least recently freed. Blocks come into being when first handed out: a small model on a large
    GPU has millions, too many to build up front at start-up.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # the blocks handed out so far: block_id = index
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_block_ids)

    def _take_free_block(self) -> int:
        if len(self.blocks) < self.num_blocks:
            self.blocks.append(Block(len(self.blocks)))
            block_id = len(self.blocks) - 1
        else:
            block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # its old content is about to be overwritten
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _release(self, block_id: int):
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_block_ids.remove(block_id)
            self.free_block_ids[block_id] = None

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for the sequence's blocks, and for the copies its forks will need (see `fork`)."""
        return self.num_free_blocks >= seq.num_blocks + self.fork_blocks(seq)

    def fork_blocks(self, seq: Sequence) -> int:
        """Blocks the forks of `seq` take at the end of its prefill: one copy each of a partly filled last block."""
        return len(seq.forks) if seq.forks and seq.num_tokens % self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the K/V of the parent's prompt: its full blocks are shared (reference counts); a partly
        filled last block gets a copy of its own, since both will write their next tokens into it. Returns
        (source block, copy) for the caller to copy the K/V, or None."""
        full = parent.num_tokens // self.block_size
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:full]
        if len(parent.block_table) == full:
            return None
        copy = self._take_free_block()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def allocate(self, seq: Sequence):
        """Give `seq` blocks for all its tokens, reusing cached leading blocks where they match."""
        assert not seq.block_table, "sequence already has blocks"
        prefix_hash = seq.cache_salt  # (-1, or its adapter's: blocks are never shared between adapters)
        hit = self.enable_prefix_caching and not seq.needs_prompt_logprobs  # (cached positions have no logits)
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            block_id = -1
            # A hit must leave the last token to compute (its logits are needed), and that token's K/V must not
            # be written into a block other requests share: so only blocks before the last token can hit.
            if hit and (i + 1) * self.block_size < seq.num_tokens:
                prefix_hash = compute_hash(token_ids, prefix_hash)
                block_id = self.hash_to_block_id.get(prefix_hash, -1)
                if block_id != -1 and self.blocks[block_id].token_ids != token_ids:
                    block_id = -1  # hash collision: the token check says it is another block
            if block_id == -1:
                hit = False
                block_id = self._take_free_block()
            else:
                block = self.blocks[block_id]
                if block_id in self.used_block_ids:
                    block.ref_count += 1
                else:  # revive a freed block that still holds this content
                    del self.free_block_ids[block_id]
                    self.used_block_ids.add(block_id)
                    block.ref_count = 1
                seq.num_cached_tokens += self.block_size
                seq.num_hashed_blocks += 1
            seq.block_table.append(block_id)

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self):
        """Forget every cached block (their K/V were computed with other weights, or freed). Only while no
        sequence holds blocks."""
        if self.used_block_ids:
            raise RuntimeError("the prefix cache can be reset only while no sequence holds KV blocks")
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks - len(seq.block_table)

    def may_append(self, seq: Sequence):
        """Before a decode step: make sure the block for the newest token exists."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence):
        """After a step: register the full blocks whose K/V are now computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, seq.num_cached_tokens // self.block_size):
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else seq.cache_salt
            token_ids = seq.block(i)
            h = compute_hash(token_ids, prefix_hash)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, token_ids
            self.hash_to_block_id.setdefault(h, block.block_id)
            seq.num_hashed_blocks = i + 1
