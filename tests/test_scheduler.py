"""Scheduler decisions, worked by hand, and a long random workload checked after every step."""
import random

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 1


def make_scheduler(**overrides) -> Scheduler:
    args = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kvcache_blocks=16,
                kvcache_block_size=4, eos_token_ids={EOS})
    return Scheduler(**{**args, **overrides})


def make_seq(num_tokens: int, first: int = 100, max_tokens: int = 8, ignore_eos: bool = False) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(list(range(first, first + num_tokens)), params)


def run_step(scheduler: Scheduler, next_token: int = 7):
    seqs, is_prefill = scheduler.schedule()
    scheduled = [(seq.seq_id, seq.num_cached_tokens, seq.num_scheduled_tokens) for seq in seqs]
    sampled = [next_token for seq in seqs if seq.samples_this_step]
    finished = scheduler.postprocess(seqs, sampled)
    scheduler.block_manager.check_integrity()
    return scheduled, is_prefill, finished


def test_prefill_batches_up_to_the_token_budget():
    scheduler = make_scheduler()
    a, b, c = make_seq(6), make_seq(6, first=200), make_seq(6, first=300)
    for seq in (a, b, c):
        scheduler.add(seq)
    scheduled, is_prefill, _ = run_step(scheduler)
    # 6 + 6 fit; c is chunked to the 4 tokens left and stays at the head of waiting.
    assert is_prefill
    assert scheduled == [(a.seq_id, 0, 6), (b.seq_id, 0, 6), (c.seq_id, 0, 4)]
    assert list(scheduler.waiting) == [c] and list(scheduler.running) == [a, b]
    assert len(a) == 7 and len(c) == 6  # a sampled its first token, c did not
    scheduled, is_prefill, _ = run_step(scheduler)
    assert is_prefill and scheduled == [(c.seq_id, 4, 2)]
    scheduled, is_prefill, _ = run_step(scheduler)
    assert not is_prefill
    assert scheduled == [(a.seq_id, 6, 1), (b.seq_id, 6, 1), (c.seq_id, 6, 1)]


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
    scheduled, is_prefill, _ = run_step(scheduler)
    assert not is_prefill  # the third waits for a free slot
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
        scheduled, is_prefill, _ = run_step(scheduler)
        assert not is_prefill and len(scheduled) == 2
    # Position 8 needs a third block for each: b, admitted last, is preempted for a.
    scheduled, _, _ = run_step(scheduler)
    assert scheduled == [(a.seq_id, 8, 1)]
    assert b.status == SequenceStatus.WAITING and list(scheduler.waiting) == [b]
    assert b.block_table == [] and b.num_cached_tokens == 0
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
        num_cache_hit_tokens += seq.num_cached_tokens

    scheduler.preempt, scheduler.block_manager.allocate = counting_preempt, counting_allocate
    for step in range(3000):
        if rng.random() < 0.3 and len(seqs) < 200:
            prompt = rng.choice(stems) + [rng.randrange(2, 50) for _ in range(rng.randrange(0, 12))]
            seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20)))
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
