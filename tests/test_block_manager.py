"""BlockManager against hand-worked block tables, reference counts and free orders (block size 4)."""
from itertools import count

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence

SEQ_IDS = count()


def make_seq(token_ids) -> Sequence:
    return Sequence(list(token_ids), seq_id=next(SEQ_IDS))


def append(seq: Sequence, token_id: int):
    seq.add_pending_token(0)
    seq.resolve_pending_token(token_id)


def test_allocate_takes_free_blocks_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))  # 3 blocks: 4 + 4 + 2
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert seq.num_computed_tokens == 0
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    assert [bm.blocks[b].ref_count for b in range(3)] == [1, 1, 1]
    bm.check_integrity()


def test_blocks_are_registered_when_scheduled_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    bm.allocate(seq)
    assert bm.hash_to_block_id == {}  # nothing computed yet
    seq.num_computed_tokens = 10  # a step computing all 10 is scheduled
    bm.hash_blocks(seq)
    h0 = BlockManager.compute_hash([0, 1, 2, 3])
    h1 = BlockManager.compute_hash([4, 5, 6, 7], h0)
    assert bm.hash_to_block_id == {h0: 0, h1: 1}  # the partial third block has no hash
    assert bm.blocks[2].hash == -1
    bm.check_integrity()


def test_hash_chains_the_prefix():
    assert BlockManager.compute_hash([4, 5, 6, 7]) != BlockManager.compute_hash([4, 5, 6, 7], 12345)


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Allocate seq and pretend a prefill step computed it whole."""
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.hash_blocks(seq)
    return seq


def test_shared_prefix_hits_and_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, make_seq(range(10)))
    b = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 99, 98, 97])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    bm.check_integrity()


def test_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, make_seq(range(8)))  # two full blocks, both registered
    again = make_seq(range(8))
    bm.allocate(again)
    # Block 1 holds the last token, whose logits are needed: recomputed into a fresh block.
    assert again.block_table == [0, 2]
    assert again.num_computed_tokens == 4
    longer = make_seq(range(9))
    bm.allocate(longer)
    assert longer.block_table == [0, 1, 3]
    assert longer.num_computed_tokens == 8
    bm.check_integrity()


def test_freed_block_keeps_its_hash_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = computed(bm, make_seq(range(9)))  # blocks 0, 1 full and hashed; 2 partial
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [3, 2, 1, 0]  # freed back to front
    b = make_seq(list(range(8)) + [50])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]  # hits on the freed blocks 0 and 1
    assert b.num_computed_tokens == 8
    assert list(bm.free_block_ids) == [2]
    bm.check_integrity()


def test_reusing_a_block_drops_its_old_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = computed(bm, make_seq(range(5)))  # block 0 hashed, block 1 partial
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [1, 0]
    b = computed(bm, make_seq([9, 9, 9, 9, 9, 9, 9, 9]))  # takes 1 then 0, overwriting block 0
    assert b.block_table == [1, 0]
    assert BlockManager.compute_hash([0, 1, 2, 3]) not in bm.hash_to_block_id
    bm.check_integrity()


def test_hit_compares_token_ids_not_only_the_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, make_seq(range(5)))
    h0 = BlockManager.compute_hash([0, 1, 2, 3])
    bm.blocks[0].token_ids = [7, 7, 7, 7]  # as if another block list had collided on h0
    seq = make_seq(range(5))
    bm.allocate(seq)
    assert seq.num_computed_tokens == 0
    assert bm.hash_to_block_id[h0] == 0


def test_can_allocate_counts_shared_hits():
    bm = BlockManager(num_blocks=5, block_size=4)
    computed(bm, make_seq(range(13)))  # blocks 0-3 used, 0-2 hashed; block 4 free
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(make_seq(range(14)))  # shares blocks 0-2, needs one fresh block
    assert not bm.can_allocate(make_seq(range(20)))  # shares blocks 0-2, needs two


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(bm, make_seq(range(9)))
    seq = make_seq(range(9))
    bm.allocate(seq)
    assert seq.num_computed_tokens == 0
    assert seq.block_table == [3, 4, 5]
    assert bm.hash_to_block_id == {}


def test_decode_appends_a_block_when_the_last_token_starts_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, make_seq(range(4)))
    append(seq, 4)  # token 4 starts block 1
    assert bm.num_new_blocks(seq) == 1
    bm.may_append(seq)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 5
    bm.hash_blocks(seq)  # block 1 is not full yet
    assert bm.blocks[1].hash == -1
    for t in (5, 6, 7):
        append(seq, t)
        bm.may_append(seq)
        seq.num_computed_tokens = len(seq)
        bm.hash_blocks(seq)
    assert seq.block_table == [0, 1]
    assert bm.blocks[1].hash == BlockManager.compute_hash([4, 5, 6, 7], bm.blocks[0].hash)
    bm.check_integrity()


def test_a_block_whose_last_token_is_pending_is_registered_when_it_arrives():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, make_seq(range(7)))  # block 1 holds 4, 5, 6
    seq.add_pending_token(row=0)  # the step computing token 6 samples token 7, not yet known here
    bm.may_append(seq)  # the next step computes token 7, whose K/V fill block 1, and samples token 8
    seq.num_computed_tokens = 8
    seq.add_pending_token(row=0)
    bm.hash_blocks(seq)
    assert seq.block_table == [0, 1] and bm.blocks[1].hash == -1  # token 7's id is unknown
    seq.resolve_pending_token(7)
    bm.hash_blocks(seq)
    assert bm.blocks[1].hash == BlockManager.compute_hash([4, 5, 6, 7], bm.blocks[0].hash)
    assert bm.blocks[1].token_ids == [4, 5, 6, 7]
    bm.check_integrity()


def test_unhash_forgets_blocks_of_a_step_that_never_ran():
    bm = BlockManager(num_blocks=8, block_size=4)
    done = computed(bm, make_seq(range(4)))  # block 0, registered by a step that ran
    seq = make_seq(range(10))
    bm.allocate(seq)  # hits block 0
    assert seq.num_hashed_blocks == 1
    seq.num_computed_tokens = 10  # a step computing tokens 4..9 is scheduled, then never launched
    bm.hash_blocks(seq)
    assert len(bm.hash_to_block_id) == 2
    bm.unhash_blocks(seq, 1)
    assert bm.hash_to_block_id == {BlockManager.compute_hash([0, 1, 2, 3]): done.block_table[0]}
    assert bm.blocks[seq.block_table[1]].hash == -1 and seq.num_hashed_blocks == 1
    bm.check_integrity()


def test_reset_prefix_cache_only_when_no_block_is_used():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, make_seq(range(9)))
    assert not bm.reset_prefix_cache() and len(bm.hash_to_block_id) == 2
    bm.deallocate(seq)
    assert bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {} and all(block.hash == -1 for block in bm.blocks)
    again = make_seq(range(9))
    bm.allocate(again)
    assert again.num_computed_tokens == 0
    bm.check_integrity()
