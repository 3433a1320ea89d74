from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: for each sequence, `num_scheduled` tokens from position `num_computed`.

    Decoding sequences (one token each) come first, then prompts being prefilled. A sequence whose
    scheduled tokens reach its end samples a new token; `sampled` lists those in row order.
    `pending_rows` gives, per sequence, the row of the previous step's samples that holds its input
    token when that token is still on the device (-1 when it is known here).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    num_hashed_before: list[int] = field(default_factory=list)
    row_samples: list[bool] = field(default_factory=list)  # per sequence: whether it samples
    sampled: list[Sequence] = field(default_factory=list)
    joined: list[Sequence] = field(default_factory=list)  # admitted in this step, each into a new sampling slot
    num_decode: int = 0


ADMISSION_BATCH_DIVISOR = 8


class Row(NamedTuple):
    seq: Sequence
    num_computed: int
    num_scheduled: int
    pending_row: int
    num_hashed_before: int
    admitted: bool  # the sequence joined the running ones in this step (and took a sampling slot)


class Scheduler:
    """Decides what each step computes, within one token budget for decode and prefill alike.

    Every running sequence gets, oldest first, one token if it decodes or the next chunk of its
    prompt; what is left of the budget admits sequences from `waiting` (preempted ones first) while
    `max_num_seqs` allows. A prompt that does not fit is prefilled in chunks over several steps. When
    a sequence runs out of blocks, the most recently admitted one is preempted: its blocks are freed
    and it goes back to the front of `waiting`, to be recomputed later (often from the prefix cache).

    A step may be scheduled before the previous one has returned its tokens (the engine prepares
    the next step while the device runs the last). So scheduling advances each sequence as if its
    step had run: `num_computed_tokens` moves past the scheduled tokens and a sampling sequence gets a
    pending token. `update_from_output` then fills in the sampled ids and finishes the sequences they
    end on tokens; the engine finishes, through `finish`, those whose text a stop string ends. A
    sequence that reaches max_tokens or max_model_len with its last token pending is not scheduled
    again; one that stops on a token still in flight wastes a step, whose token is dropped.

    A running sequence holds one of max_num_seqs sampling slots, its row of the sampler's state on the
    device: taken when it is admitted, given back when it finishes or is preempted. A slot given back
    may be taken again at once, even by the step that preempted its sequence: the device runs the steps
    in order, on one stream, so a step's joins are written after every earlier step has used the slot.
    """

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_kvcache_blocks: int, kvcache_block_size: int, eos_token_ids=frozenset(),
                 enable_prefix_caching: bool = True, chunks_prompts: bool = True):
        self.max_num_seqs = max_num_seqs
        self.chunks_prompts = chunks_prompts  # False: a prompt is prefilled whole, in one step
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stop_checker = StopChecker(eos_token_ids, max_model_len)
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.free_sampling_slots = list(reversed(range(max_num_seqs)))
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.stop_checker.set_token_limit(seq)
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        decodes: list[Row] = []
        prompts: list[Row] = []  # the other rows: prompt chunks, and the rows of sequences admitted now
        budget = self._schedule_running(decodes, prompts, self.max_num_batched_tokens)
        self._schedule_waiting(prompts, budget)
        return self._output(decodes, prompts)

    def _schedule_running(self, decodes: list["Row"], prompts: list["Row"], budget: int) -> int:
        """Every running sequence, oldest first: one token if it decodes, else its prompt's next chunk.

        This loop runs for every sequence at every step, so a decode, by far the commonest row, takes
        the short way: its length limit (`StopChecker.set_token_limit`'s), `BlockManager.num_new_blocks`' and
        `hash_blocks`' tests are asked inline, and it calls out only where its token starts a block or fills one."""
        block_size, running = self.block_manager.block_size, SequenceStatus.RUNNING  # (an Enum member's lookup is slow)
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted below for an older sequence
            if not budget:
                break
            if seq.num_pending_tokens and seq.num_tokens >= seq.max_num_tokens:
                continue  # it reaches its length limit: it finishes once its pending tokens arrive
            if seq.num_tokens > len(seq.block_table) * block_size and not self._reserve_blocks(seq):
                continue  # its next token needs a block, and it was preempted for want of one
            if seq.num_tokens - seq.num_computed_tokens == 1:
                # A Row as a plain tuple, the cheaper to build: one token, not admitted.
                decodes.append((seq, seq.num_computed_tokens, 1, seq.pending_row if seq.num_pending_tokens else -1,
                                seq.num_hashed_blocks, False))
                seq.num_computed_tokens += 1
                if (seq.num_computed_tokens // block_size > seq.num_hashed_blocks
                        and len(seq.token_ids) // block_size > seq.num_hashed_blocks):
                    self.block_manager.hash_blocks(seq)  # it filled a block (hash_blocks' own test)
                budget -= 1
            else:
                prompts.append(self._advance(seq, budget, admitted=False))
                budget -= prompts[-1].num_scheduled
        return budget

    def _reserve_blocks(self, seq: Sequence) -> bool:
        """Room for seq's next token, preempting the newest running sequences (seq itself last)."""
        num_new_blocks = self.block_manager.num_new_blocks(seq)
        while self.block_manager.num_free_blocks < num_new_blocks:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.may_append(seq)
        return True

    def _schedule_waiting(self, prompts: list["Row"], budget: int):
        """Preempted sequences, then new prompts, while the budget, the blocks and max_num_seqs allow."""
        if not self._admits_now():
            return
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            assert seq.max_num_tokens > 0, "a sequence comes to the scheduler through add(), which sets its limit"
            if seq.num_pending_tokens:
                break  # preempted with its last token still in flight: it needs that token's id
            if not self.block_manager.can_allocate(seq):
                break
            if not self.chunks_prompts and seq.num_tokens - seq.num_computed_tokens > budget:
                break
            self.block_manager.allocate(seq)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.sampling_slot = self.free_sampling_slots.pop()
            self.running.append(seq)
            prompts.append(self._advance(seq, budget, admitted=True))
            budget -= prompts[-1].num_scheduled

    def _admits_now(self) -> bool:
        """Sequences join in batches: a step that prefills costs the host about as much for one short
        prompt as for a hundred, so while the seats are nearly full, wait until a batch's worth is free
        (an eighth of max_num_seqs, or as many as wait)."""
        batch = min(len(self.waiting), max(1, self.max_num_seqs // ADMISSION_BATCH_DIVISOR))
        return self.max_num_seqs - len(self.running) >= batch

    def _advance(self, seq: Sequence, budget: int, admitted: bool) -> "Row":
        """Schedule as many of seq's uncomputed tokens as the budget allows and move it past them, as if
        the step had run; blocks they fill are registered at once, so a later sequence of the same step
        can hit them."""
        num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
        row = Row(seq, seq.num_computed_tokens, num_tokens, seq.pending_row if seq.num_pending_tokens else -1,
                  seq.num_hashed_blocks, admitted)
        seq.num_computed_tokens += num_tokens
        self.block_manager.hash_blocks(seq)
        return row

    @staticmethod
    def _output(decodes: list["Row"], prompts: list["Row"]) -> SchedulerOutput:
        """The step's rows, decodes first; each row that reaches its sequence's end samples, and its
        sequence gets a pending token.

        A decode computes the one last token of a sequence that was already running, so it reads only
        keys of earlier steps (and its own). The runner computes decodes before the other rows (decode
        graphs, then the prompts' varlen pass): a sequence admitted in this step may hit blocks that
        another one fills in this step, so it goes with the prompt rows even when one token is left."""
        out = SchedulerOutput(num_decode=len(decodes))
        rows = decodes + prompts
        if not rows:
            return out
        seqs, out.num_computed, out.num_scheduled, out.pending_rows, out.num_hashed_before, _ = (
            list(column) for column in zip(*rows))
        out.seqs, out.joined = seqs, [row.seq for row in prompts if row.admitted]
        out.row_samples = [True] * len(decodes) + [row.seq.num_computed_tokens == row.seq.num_tokens for row in prompts]
        out.sampled = [seq for seq, samples in zip(seqs, out.row_samples) if samples]
        for row, seq in enumerate(out.sampled):
            seq.add_pending_token(row)
        return out

    def preempt(self, seq: Sequence):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self._free_sampling_slot(seq)
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def _free_sampling_slot(self, seq: Sequence):
        if seq.sampling_slot >= 0:
            self.free_sampling_slots.append(seq.sampling_slot)
            seq.sampling_slot = -1

    def update_from_output(self, out: SchedulerOutput, token_ids: list[int]) -> list[int]:
        """Fill in the tokens that `out`'s step sampled, one per `out.sampled`, and finish the sequences
        they end; returns the rows whose sequences took their token (the others had stopped already)."""
        accepted, block_size = [], self.block_manager.block_size
        for row, (seq, token_id) in enumerate(zip(out.sampled, token_ids)):
            if seq.is_finished:
                continue  # stopped on an earlier token, or aborted, while this step ran
            accepted.append(row)
            seq.resolve_pending_token(token_id)
            if (len(seq.token_ids) // block_size > seq.num_hashed_blocks
                    and seq.num_computed_tokens // block_size > seq.num_hashed_blocks):
                self.block_manager.hash_blocks(seq)  # its token filled a block (hash_blocks' own test)
            reason = self.stop_checker.check(seq)
            if reason is not None:
                self.finish(seq, *reason)
        return accepted

    def unschedule(self, out: SchedulerOutput):
        """Forget the prefix-cache entries of a step that was scheduled but never launched."""
        for seq, num_hashed in zip(out.seqs, out.num_hashed_before):
            self.block_manager.unhash_blocks(seq, num_hashed)

    def finish_pooled(self, out: SchedulerOutput) -> list[int]:
        """A pooling engine's step: each sequence whose prompt it ended is done, its blocks kept in the prefix
        cache for later prompts; returns their rows (not those aborted while the step ran)."""
        rows = [row for row, seq in enumerate(out.sampled) if not seq.is_finished]
        for row in rows:
            self.block_manager.hash_blocks(out.sampled[row])
            self.finish(out.sampled[row], "stop")
        return rows

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """Finish seq and free its blocks; a sequence finished already only takes the new reasons (a stop
        string in the text of the token that reached its length limit)."""
        if seq.is_finished:
            seq.finish(reason, stop_reason)
            return
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        seq.finish(reason, stop_reason)
        self._free_sampling_slot(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        if seq in queue:
            queue.remove(seq)

    def abort(self, seqs: list[Sequence]):
        """Drop `seqs` wherever they are and free their blocks."""
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")
