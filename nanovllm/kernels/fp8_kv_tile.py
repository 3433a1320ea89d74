"""A tile of the FP8 KV cache (`utils/fp8_kv.py`) as the decode and prompt attention kernels read it."""
import triton
import triton.language as tl


@triton.jit
def fp8_kv_tile(k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block, keys, has_key, kv_head, dims,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The keys and the values at `keys` of one KV head, e4m3 unscaled, [keys, dims] each, and their scales
    [keys] (0 past has_key). `block`: the cache block of each key, or one block id where the tile lies in one.
    Keys and values are read unmasked (past a sequence's keys the zeroed cache holds finite values: the caller
    weighs them by zero); dims past HEAD_DIM read as zeros. The values are read as they lie, [dims, keys], so that
    the P.V product loads them from shared memory with ldmatrix rather than a byte at a time."""
    slot, block = keys % BLOCK_SIZE, block.to(tl.int64)
    block_head = block * NUM_KV_HEADS + kv_head
    has_dim = dims < HEAD_DIM
    key_rows = (block * BLOCK_SIZE + slot) * NUM_KV_HEADS + kv_head
    k = tl.load(k_cache_ptr + key_rows[:, None] * HEAD_DIM + dims[None, :], mask=has_dim[None, :], other=0.0)
    value_rows = block_head * (HEAD_DIM * BLOCK_SIZE) + value_offsets(slot, 0, HEAD_DIM, BLOCK_SIZE)
    v = tl.load(v_cache_ptr + value_rows[None, :] + value_offsets(0, dims, HEAD_DIM, BLOCK_SIZE)[:, None],
                mask=has_dim[:, None], other=0.0)
    scales = block_head * BLOCK_SIZE + slot
    key_scales = tl.load(k_scales_ptr + scales, mask=has_key, other=0.0)
    value_scales = tl.load(v_scales_ptr + scales, mask=has_key, other=0.0)
    return k, tl.trans(v), key_scales, value_scales


@triton.jit
def value_offsets(slot, dim, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Where the value of (slot in block, dim) lies within its (block, kv head)'s values in an FP8 cache: [slot
    group, dim, slot in group], groups of `utils.fp8_kv.value_group_slots(BLOCK_SIZE)` slots."""
    GROUP: tl.constexpr = 64 if BLOCK_SIZE % 64 == 0 else 32 if BLOCK_SIZE % 32 == 0 else 16
    # (slot // GROUP) * HEAD_DIM * GROUP + slot % GROUP + dim * GROUP, in fewer operations
    return (slot // GROUP) * ((HEAD_DIM - 1) * GROUP) + slot + dim * GROUP
