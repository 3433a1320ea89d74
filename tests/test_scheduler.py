"""Scheduler decisions, worked by hand, and a long random workload checked after every step."""
import random
from itertools import count

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 1
SEQ_IDS = count()


def make_scheduler(**overrides) -> Scheduler:
    args = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kvcache_blocks=16,
                kvcache_block_size=4, eos_token_ids={EOS})
    return Scheduler(**{**args, **overrides})


def make_seq(num_tokens: int, first: int = 100, max_tokens: int = 8, ignore_eos: bool = False) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(list(range(first, first + num_tokens)), params, seq_id=next(SEQ_IDS))


def scheduled_of(out) -> list[tuple[int, int, int]]:
    """(seq_id, tokens already computed, tokens scheduled) per scheduled sequence."""
    return [(seq.seq_id, computed, count)
            for seq, computed, count in zip(out.seqs, out.num_computed, out.num_scheduled)]


def finished_by(scheduler: Scheduler, out, token_ids: list[int]) -> list[Sequence]:
    """Give out's sampled rows their tokens; returns the sequences that these tokens finished."""
    rows = scheduler.update_from_output(out, token_ids)
    return [out.sampled[row] for row in rows if out.sampled[row].is_finished]


def run_step(scheduler: Scheduler, next_token: int = 7):
    """Schedule a step and give every sampling sequence next_token; returns (scheduled, num_decode, finished)."""
    out = scheduler.schedule()
    finished = finished_by(scheduler, out, [next_token] * len(out.sampled))
    scheduler.block_manager.check_integrity()
    return scheduled_of(out), out.num_decode, finished


def test_prefill_batches_up_to_the_token_budget():
    scheduler = make_scheduler()
    a, b, c = make_seq(6), make_seq(6, first=200), make_seq(6, first=300)
    for seq in (a, b, c):
        scheduler.add(seq)
    scheduled, num_decode, _ = run_step(scheduler)
    # 6 + 6 fit; c is admitted with a chunk of the 4 tokens left, the rest to come.
    assert num_decode == 0
    assert scheduled == [(a.seq_id, 0, 6), (b.seq_id, 0, 6), (c.seq_id, 0, 4)]
    assert not scheduler.waiting and list(scheduler.running) == [a, b, c]
    assert len(a) == 7 and len(c) == 6  # a sampled its first token, c did not
    # a and b decode in the same step as the rest of c's prompt: one budget for both.
    scheduled, num_decode, _ = run_step(scheduler)
    assert num_decode == 2 and scheduled == [(a.seq_id, 6, 1), (b.seq_id, 6, 1), (c.seq_id, 4, 2)]
    scheduled, num_decode, _ = run_step(scheduler)
    assert num_decode == 3 and scheduled == [(a.seq_id, 7, 1), (b.seq_id, 7, 1), (c.seq_id, 6, 1)]


def test_decoding_sequences_come_first_and_new_prompts_take_what_is_left():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(5, max_tokens=20)
    scheduler.add(a)
    run_step(scheduler)
    b = make_seq(10, first=200)
    scheduler.add(b)
    scheduled, num_decode, _ = run_step(scheduler)
    assert num_decode == 1 and scheduled == [(a.seq_id, 5, 1), (b.seq_id, 0, 7)]
    scheduled, num_decode, _ = run_step(scheduler)
    assert num_decode == 1 and scheduled == [(a.seq_id, 6, 1), (b.seq_id, 7, 3)]


def test_a_long_prompt_is_prefilled_in_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(20)
    scheduler.add(seq)
    steps = [run_step(scheduler)[0] for _ in range(3)]
    assert steps == [[(seq.seq_id, 0, 8)], [(seq.seq_id, 8, 8)], [(seq.seq_id, 16, 4)]]
    assert seq.block_table == [0, 1, 2, 3, 4]
    assert seq.num_completion_tokens == 1


def test_max_num_seqs_bounds_running_sequences():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(3, first=100 * i) for i in range(1, 4)]
    for seq in seqs:
        scheduler.add(seq)
    scheduled, _, _ = run_step(scheduler)
    assert [s[0] for s in scheduled] == [seqs[0].seq_id, seqs[1].seq_id]
    scheduled, num_decode, _ = run_step(scheduler)
    assert num_decode == len(scheduled) == 2  # the third waits for a free slot
    assert list(scheduler.waiting) == [seqs[2]]


def test_decode_preempts_the_most_recently_admitted():
    # 4 blocks of 4: a and b take 2 blocks each for 5 tokens, leaving none.
    scheduler = make_scheduler(num_kvcache_blocks=4, max_model_len=16)
    a, b = make_seq(5, ignore_eos=True), make_seq(5, first=200, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    for _ in range(3):  # tokens at positions 5, 6, 7 fit in the second blocks
        scheduled, num_decode, _ = run_step(scheduler)
        assert num_decode == len(scheduled) == 2
    # Position 8 needs a third block for each: b, admitted last, is preempted for a.
    scheduled, _, _ = run_step(scheduler)
    assert scheduled == [(a.seq_id, 8, 1)]
    assert b.status == SequenceStatus.WAITING and list(scheduler.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_table == [0, 1, 3]  # b's blocks went back to the free queue, 3 first (freed last to first)


def test_preempted_sequence_resumes_from_the_prefix_cache():
    scheduler = make_scheduler(num_kvcache_blocks=5, max_model_len=20)
    a, b = make_seq(8, ignore_eos=True, max_tokens=12), make_seq(4, first=200, ignore_eos=True, max_tokens=12)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    while b.status != SequenceStatus.WAITING:
        run_step(scheduler)
    tokens_before = list(b.token_ids)
    while b.status == SequenceStatus.WAITING:
        run_step(scheduler)
    # b's full blocks were registered before it was preempted, so they come back as cache hits
    # (unless a's growth reused them), and b's tokens are intact.
    assert b.token_ids[:len(tokens_before)] == tokens_before
    while not scheduler.is_finished():
        run_step(scheduler)
    assert a.num_completion_tokens == 12 and b.num_completion_tokens == 12


def test_finish_reasons():
    scheduler = make_scheduler(max_model_len=10)
    eos = make_seq(3, max_tokens=8)
    ignores_eos = make_seq(3, first=200, max_tokens=2, ignore_eos=True)
    too_long = make_seq(8, first=300, max_tokens=8, ignore_eos=True)
    for seq in (eos, ignores_eos, too_long):
        scheduler.add(seq)
    _, _, finished = run_step(scheduler, next_token=EOS)
    assert finished == [eos]
    _, _, finished = run_step(scheduler, next_token=EOS)
    assert finished == [ignores_eos, too_long]  # max_tokens=2; 10 tokens = max_model_len
    assert ignores_eos.completion_token_ids == [EOS, EOS]
    assert scheduler.is_finished()
    assert scheduler.block_manager.num_free_blocks == 16


def test_random_workload_keeps_the_block_manager_consistent():
    rng = random.Random(0)
    scheduler = make_scheduler(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48,
                               num_kvcache_blocks=14, kvcache_block_size=4)
    stems = [[rng.randrange(2, 50) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    seqs, num_preempted, num_cache_hit_tokens = [], 0, 0
    original_preempt, original_allocate = scheduler.preempt, scheduler.block_manager.allocate

    def counting_preempt(seq):
        nonlocal num_preempted
        num_preempted += 1
        original_preempt(seq)

    def counting_allocate(seq):
        nonlocal num_cache_hit_tokens
        original_allocate(seq)
        num_cache_hit_tokens += seq.num_computed_tokens

    scheduler.preempt, scheduler.block_manager.allocate = counting_preempt, counting_allocate
    for step in range(3000):
        if rng.random() < 0.3 and len(seqs) < 200:
            prompt = rng.choice(stems) + [rng.randrange(2, 50) for _ in range(rng.randrange(0, 12))]
            seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20)), seq_id=next(SEQ_IDS))
            scheduler.add(seq)
            seqs.append(seq)
        if not scheduler.is_finished():
            run_step(scheduler, next_token=rng.randrange(0, 50))
        held = sum(len(s.block_table) for s in seqs)
        refs = sum(b.ref_count for b in scheduler.block_manager.blocks)
        assert held == refs, f"step {step}: sequences hold {held} block references, blocks count {refs}"
    while not scheduler.is_finished():
        run_step(scheduler)
    assert num_preempted > 10 and num_cache_hit_tokens > 100
    assert all(seq.is_finished for seq in seqs)
    assert scheduler.block_manager.num_free_blocks == 14


def test_the_next_step_is_scheduled_before_the_last_has_returned():
    scheduler = make_scheduler()
    a = make_seq(5, max_tokens=3, ignore_eos=True)
    scheduler.add(a)
    first = scheduler.schedule()
    assert scheduled_of(first) == [(a.seq_id, 0, 5)] and a.num_pending_tokens == 1
    # Token 5 was sampled by the first step, still on the device: its id comes from row 0 there.
    second = scheduler.schedule()
    assert scheduled_of(second) == [(a.seq_id, 5, 1)] and second.pending_rows == [0]
    third = scheduler.schedule()
    assert scheduled_of(third) == [(a.seq_id, 6, 1)] and third.pending_rows == [0]
    assert len(a) == 8 and a.num_pending_tokens == 3 and len(a.token_ids) == 5
    assert scheduler.schedule().seqs == []  # its pending tokens already reach max_tokens=3
    assert finished_by(scheduler, first, [11]) == []
    assert finished_by(scheduler, second, [12]) == []
    assert finished_by(scheduler, third, [13]) == [a]
    assert a.completion_token_ids == [11, 12, 13] and a.finish_reason == "length"
    assert scheduler.is_finished() and scheduler.block_manager.num_free_blocks == 16


def two_steps_of_two_sequences(scheduler: Scheduler):
    """Two prompts, prefilled by one step and decoded by the next, scheduled before the first returns."""
    a, b = make_seq(5, max_tokens=8), make_seq(5, first=200, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    return a, b, scheduler.schedule(), scheduler.schedule()


def test_a_sequence_that_stops_while_its_next_step_runs_drops_that_steps_token():
    scheduler = make_scheduler()
    a, b, first, second = two_steps_of_two_sequences(scheduler)
    assert finished_by(scheduler, first, [EOS, 7]) == [a]
    assert a.completion_token_ids == [EOS] and len(a) == 6 and not a.block_table
    assert (a.finish_reason, a.stop_reason) == ("stop", None)
    assert finished_by(scheduler, second, [9, 9]) == []  # a's token from the second step is dropped
    assert a.completion_token_ids == [EOS] and b.completion_token_ids == [7, 9]
    assert list(scheduler.running) == [b]
    scheduler.block_manager.check_integrity()


def test_a_preempted_sequence_waits_for_its_pending_token_before_it_is_recomputed():
    scheduler = make_scheduler()
    a, b = make_seq(4, ignore_eos=True), make_seq(4, first=200, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    scheduler.preempt(b)  # as decode would when out of blocks; b's first token is still on the device
    second = scheduler.schedule()
    assert scheduled_of(second) == [(a.seq_id, 4, 1)]  # b is not admitted: its last token is unknown
    assert list(scheduler.waiting) == [b]
    scheduler.update_from_output(first, [7, 8])
    scheduler.update_from_output(second, [9])
    third = scheduler.schedule()
    # b comes back with its prompt block from the prefix cache and recomputes only its sampled token.
    assert scheduled_of(third) == [(a.seq_id, 5, 1), (b.seq_id, 4, 1)]
    assert third.num_decode == 1 and b.token_ids == [200, 201, 202, 203, 8]  # b was admitted: a prompt row


def test_unschedule_forgets_the_blocks_a_step_would_have_filled():
    scheduler = make_scheduler()
    a = make_seq(9)
    scheduler.add(a)
    out = scheduler.schedule()
    assert len(scheduler.block_manager.hash_to_block_id) == 2
    scheduler.unschedule(out)
    assert scheduler.block_manager.hash_to_block_id == {}


def test_new_sequences_join_in_batches_while_the_seats_are_nearly_full():
    scheduler = make_scheduler(max_num_seqs=16, max_num_batched_tokens=64, num_kvcache_blocks=64)
    running = [make_seq(3, first=100 + 10 * i, max_tokens=2 + i) for i in range(16)]
    for seq in running:
        scheduler.add(seq)
    run_step(scheduler)
    assert len(scheduler.running) == 16
    waiting = [make_seq(3, first=400 + 10 * i) for i in range(5)]
    for seq in waiting:
        scheduler.add(seq)
    # A batch is 16 // 8 = 2 seats: with one free seat nobody joins, with two both the next two do.
    _, num_decode, finished = run_step(scheduler)
    assert len(finished) == 1 and len(scheduler.waiting) == 5
    scheduled, num_decode, _ = run_step(scheduler)
    assert [row[0] for row in scheduled[num_decode:]] == [] and len(scheduler.running) == 14
    scheduled, num_decode, _ = run_step(scheduler)
    assert [row[0] for row in scheduled[num_decode:]] == [waiting[0].seq_id, waiting[1].seq_id]


def test_the_rows_that_take_their_token():
    scheduler = make_scheduler()
    a, b, first, second = two_steps_of_two_sequences(scheduler)
    assert scheduler.update_from_output(first, [EOS, 7]) == [0, 1]  # both took a token; a's ended it
    assert scheduler.update_from_output(second, [9, 9]) == [1]  # a had stopped: its row is left out
