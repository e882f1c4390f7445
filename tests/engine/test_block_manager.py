from nanovllm.engine.block_manager import BlockManager, compute_hash
from nanovllm.engine.sequence import Sequence

BS = 16


def _seq(tokens):
    return Sequence(list(tokens), BS)


def _finish_prefill(bm: BlockManager, seq: Sequence):
    """What the scheduler does after a prefill step computed every prompt token."""
    seq.num_cached_tokens = seq.num_tokens
    bm.hash_blocks(seq)


def test_hash_chain_depends_on_prefix():
    """A block's hash covers its tokens and the hash of the block before it (-1: the first block)."""
    x, y = list(range(BS)), list(range(100, 100 + BS))
    after_x = compute_hash(y, compute_hash(x))
    assert after_x == compute_hash(list(y), compute_hash(list(x)))  # by value, deterministic
    assert after_x != compute_hash(y)  # the same tokens as a first block
    assert after_x != compute_hash(y, compute_hash(y))  # the same tokens after another block
    assert compute_hash(y, 0) != compute_hash(y)  # prefix 0 is a prefix, not "none"
    assert compute_hash(x) != compute_hash(x[::-1])


def test_allocate_and_free_counts():
    bm = BlockManager(8, BS)
    seq = _seq(range(40))  # 3 blocks, the last one partial
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5 and seq.num_cached_tokens == 0
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and not seq.block_table


def test_blocks_are_handed_out_unused_first_then_least_recently_freed():
    # a pool of millions costs nothing until used (blocks are built when first handed out); never-used blocks go
    # first, in id order, then freed ones, least recently freed first (cached content kept as long as possible)
    big = BlockManager(50_000_000, BS)
    assert big.num_free_blocks == 50_000_000 and not big.blocks
    bm = BlockManager(6, BS)
    a, b = _seq(range(40)), _seq(range(100, 132))  # 3 blocks and 2
    bm.allocate(a)
    bm.allocate(b)
    assert (a.block_table, b.block_table, len(bm.blocks)) == ([0, 1, 2], [3, 4], 5)
    bm.deallocate(b)  # freed in reverse: 4, then 3
    bm.deallocate(a)  # 2, 1, 0
    c = _seq(range(200, 280))  # 5 blocks: the unused 5, then the least recently freed 4, 3, 2, 1
    bm.allocate(c)
    assert c.block_table == [5, 4, 3, 2, 1] and bm.num_free_blocks == 1 and len(bm.blocks) == 6


def test_only_computed_blocks_are_cached():
    bm = BlockManager(8, BS)
    a = _seq(range(40))
    bm.allocate(a)
    b = _seq(range(40))
    bm.allocate(b)  # a's K/V are not computed yet: no hit
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_prefix_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    a = _seq(range(40))
    bm.allocate(a)
    _finish_prefill(bm, a)
    b = _seq(list(range(32)) + [99] * 5)
    bm.allocate(b)
    assert b.num_cached_tokens == 32 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert bm.num_free_blocks == 8 - 3


def test_freed_blocks_are_revived():
    bm = BlockManager(4, BS)
    a = _seq(range(33))
    bm.allocate(a)
    _finish_prefill(bm, a)
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = _seq(range(33))
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_cached_tokens == 32


def test_full_prompt_hit_recomputes_last_token():
    bm = BlockManager(4, BS)
    a = _seq(range(32))
    bm.allocate(a)
    _finish_prefill(bm, a)
    b = _seq(range(32))
    bm.allocate(b)
    # logits of the last token are still needed, and its K/V must not be rewritten into a shared block:
    # the block holding it is recomputed into a fresh block
    assert b.num_cached_tokens == 16
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_reused_block_drops_its_old_hash():
    bm = BlockManager(2, BS)
    a = _seq(range(16))
    bm.allocate(a)
    _finish_prefill(bm, a)
    bm.deallocate(a)
    c = _seq([7] * 32)  # takes both free blocks, overwriting a's cached block
    bm.allocate(c)
    bm.deallocate(c)
    b = _seq(list(range(16)) + [1])
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(4, BS)
    a = _seq(range(17))
    bm.allocate(a)
    _finish_prefill(bm, a)
    # pretend another block's tokens hash to the same value
    fake = list(range(100, 116))
    bm.hash_to_block_id[compute_hash(fake)] = a.block_table[0]
    b = _seq(fake + [1])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_append_needs_a_block_at_boundaries():
    bm = BlockManager(3, BS)
    seq = _seq(range(16))
    bm.allocate(seq)
    seq.num_cached_tokens = 16
    seq.append_token(1)  # token 17 starts block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.append_token(2)
    bm.may_append(seq)  # still inside block 2
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = _seq(range(40))
    bm.allocate(a)
    _finish_prefill(bm, a)
    b = _seq(range(40))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_equal_block_after_another_prefix_does_not_hit():
    """Prefix hashes chain: block Y cached after X is not Y as a first block (its K/V saw X)."""
    bm = BlockManager(8, BS)
    x, y = list(range(BS)), list(range(100, 100 + BS))
    a = _seq(x + y + [1, 2])
    bm.allocate(a)
    _finish_prefill(bm, a)
    b = _seq(y + [3, 4])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] not in a.block_table
    c = _seq(x + y + [5])  # the same chain does hit
    bm.allocate(c)
    assert c.num_cached_tokens == 2 * BS and c.block_table[:2] == a.block_table[:2]


def test_least_recently_freed_block_is_evicted_first():
    """Freed blocks stay cached; new content takes the one freed longest ago, whatever the block ids."""
    for first, second in ((0, 1), (1, 0)):
        bm = BlockManager(3, BS)
        contents = [[10] * BS, [20] * BS]
        seqs = [_seq(c) for c in contents]
        for seq in seqs:  # one full block each, computed and cached
            bm.allocate(seq)
            _finish_prefill(bm, seq)
        bm.deallocate(seqs[first])
        bm.deallocate(seqs[second])
        new = _seq([30] * (2 * BS))  # two blocks: the never-used one, then the oldest freed one
        bm.allocate(new)
        bm.deallocate(new)
        hits = {}
        for i in (second, first):  # the survivor first: a probe takes a free block itself
            probe = _seq(contents[i] + [1])
            bm.allocate(probe)
            hits[i] = probe.num_cached_tokens
            bm.deallocate(probe)
        assert hits == {first: 0, second: BS}, (first, second)
