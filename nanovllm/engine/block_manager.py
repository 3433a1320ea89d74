from array import array
from collections import deque

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]):
        self.hash = hash
        self.token_ids = token_ids

    def reset(self):
        self.hash = -1
        self.token_ids = []


class BlockManager:
    """Paged KV-cache bookkeeping with hash-based prefix caching.

    A full block is keyed by xxhash64 of its token ids chained with the previous block's hash,
    so a key stands for the whole prefix up to the block's end. A new sequence walks its full
    blocks and reuses every one found in `hash_to_block_id`, up to the first miss. Hashes can
    collide, so a hit also compares the block's token ids. A freed block keeps its hash and goes
    to the back of the free queue, so an identical prompt arriving later still hits until the
    block is handed out again.

    The last token of a sequence is never taken from the cache: its logits are needed to sample
    the next token, and computing it into a fresh block never writes into a block that other
    sequences share. A block is registered under its hash once a scheduled step fills it and its
    token ids are known: within a step every layer stores K/V before it attends, and steps run in
    order on the device, so any sequence scheduled from then on may read it. A token still being
    sampled on the device is not known yet; its block is registered when it arrives.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens looked up, and found cached
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    def num_blocks(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks holding seq's leading full blocks, stopping before its last token."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # scoring the prompt needs every position computed
        hits, h = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = self._block_tokens(seq, i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def _allocate_block(self, block_id: int) -> int:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        block.ref_count = 1
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block_id

    def _reuse_block(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.remove(block_id)
            self.used_block_ids.add(block_id)
        block.ref_count += 1
        return block_id

    def _deallocate_block(self, block_id: int):
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        num_shared = sum(self.blocks[b].ref_count > 0 for b in self._cache_hits(seq))
        return self.num_free_blocks >= self.num_blocks(len(seq)) - num_shared

    def allocate(self, seq: Sequence):
        assert not seq.block_table
        hits = self._cache_hits(seq)
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += len(hits) * self.block_size
        seq.block_table = [self._reuse_block(b) for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        for _ in range(len(hits), self.num_blocks(len(seq))):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]))

    def deallocate(self, seq: Sequence):
        # Freed back to front, so a prefix's first blocks stay cached the longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.block_table = []

    def num_new_blocks(self, seq: Sequence) -> int:
        """The blocks seq's tokens need beyond its block table's (a decode's last token starts one at most)."""
        return max(0, (seq.num_tokens + self.block_size - 1) // self.block_size - len(seq.block_table))

    def may_append(self, seq: Sequence):
        """Give seq the new blocks its tokens need (num_new_blocks; free blocks must be there)."""
        for _ in range(self.num_new_blocks(seq)):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]))

    def hash_blocks(self, seq: Sequence):
        """Register seq's blocks that are full of computed tokens with known ids."""
        num_full_blocks = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full_blocks <= seq.num_hashed_blocks or not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, num_full_blocks):
            prefix = self.blocks[seq.block_table[i - 1]].hash if i else -1
            token_ids = self._block_tokens(seq, i)
            h = self.compute_hash(token_ids, prefix)
            self.blocks[seq.block_table[i]].update(h, token_ids)
            self.hash_to_block_id[h] = seq.block_table[i]
        seq.num_hashed_blocks = num_full_blocks

    def unhash_blocks(self, seq: Sequence, num_blocks_kept: int):
        """Forget seq's blocks past the first `num_blocks_kept`: a step meant to fill them never ran."""
        for block_id in seq.block_table[num_blocks_kept:seq.num_hashed_blocks]:
            block = self.blocks[block_id]
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.reset()
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_blocks_kept)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible while no block is in use (as in vLLM)."""
        if self.used_block_ids:
            return False
        for block in self.blocks:
            block.reset()
        self.hash_to_block_id.clear()
        return True

    def check_integrity(self):
        """Assert the invariants: every block is free xor used, and every hash entry is honest."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is queued twice as free"
        assert not free & self.used_block_ids, "a block is both free and used"
        assert len(free) + len(self.used_block_ids) == len(self.blocks), "a block is neither free nor used"
        for block in self.blocks:
            assert (block.ref_count > 0) == (block.block_id in self.used_block_ids), f"block {block.block_id}"
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == h, f"hash entry points at block {block_id}, which lost it"
