from collections import deque

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides what each step computes: prefill first, else one decode token for each running sequence.

    `waiting` holds sequences with prompt tokens left to compute; a prompt that does not fit the
    step's token budget is prefilled in chunks and stays at the head of `waiting` (holding its
    blocks) until its last chunk. `running` holds sequences that decode, oldest first. When decode
    runs out of blocks, the most recently admitted sequence is preempted: its blocks are freed
    and it goes back to the front of `waiting`, to be recomputed later (often from the prefix cache).
    """

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_kvcache_blocks: int, kvcache_block_size: int, eos_token_ids=frozenset(),
                 enable_prefix_caching: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return the sequences of the next step and whether it is a prefill step."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if seq.num_prompt_cache_hits < 0:
                    seq.num_prompt_cache_hits = seq.num_cached_tokens
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.block_manager.hash_blocks(seq)
            scheduled.append(seq)
            if not seq.samples_this_step:
                break  # a chunk: the rest of this prompt goes first next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                self.block_manager.hash_blocks(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Advance the step's sequences; `token_ids` has one entry per sequence that sampled.
        Returns the sequences that finished."""
        new_tokens = iter(token_ids)
        finished = []
        for seq in seqs:
            samples = seq.samples_this_step
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if not samples:
                continue
            seq.append_token(next(new_tokens))
            reason = self._finish_reason(seq)
            if reason:
                self.finish(seq, *reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        seq.finish(reason, stop_reason)
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seqs: list[Sequence]):
        """Drop `seqs` wherever they are and free their blocks."""
        for seq in seqs:
            if seq.block_table:
                self.block_manager.deallocate(seq)
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)

    def _finish_reason(self, seq: Sequence) -> tuple[str, int | None] | None:
        """("stop", None) on EOS, ("stop", id) on a stop token id, ("length", None) at max_tokens or
        max_model_len. End-of-sequence and stop ids count only once min_tokens are generated."""
        params, token = seq.sampling_params, seq.last_token
        if seq.num_completion_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length", None
        return None
