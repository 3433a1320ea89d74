"""Sampling filters, seeds and penalties against references computed in float64 from transformers' logits."""
from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import NO_FILTER, Sampler, cut_sorted, process_native, seeded_exponential
from nanovllm.layers.sampling_state import IN_PROMPT, SamplingState

from conftest import reference_logits
from sampling_checks import check_processed_logits_match_transformers, chi_square_p_value, reference_distribution

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=256, max_num_seqs=512,
                   dtype="float32", device="cpu")
PROMPT = [5, 17, 200, 33, 41]
NUM_DRAWS = 3000


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()  # sorted, descending
    cut = cut_sorted(scores, top_k=torch.tensor([0]), top_p=torch.tensor([0.6]), min_p=torch.tensor([0.0]))
    assert cut.item() == scores[0, 1].item()
    top_2 = cut_sorted(scores, top_k=torch.tensor([3]), top_p=torch.tensor([0.5]), min_p=torch.tensor([0.0]))
    assert top_2.item() == scores[0, 1].item()  # 0.4 of the 0.9 left is under half: 0.3 crosses it
    min_p = cut_sorted(scores, top_k=torch.tensor([0]), top_p=torch.tensor([1.0]), min_p=torch.tensor([0.8]))
    assert min_p.item() == scores[0, 0].item()  # 0.3 < 0.8 x 0.4


FILTERS = [
    dict(top_k=12),
    dict(top_p=0.5),
    dict(min_p=0.4),
    dict(min_p=0.1, top_k=40, top_p=0.8),
]


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filtered_draws_follow_the_renormalised_distribution(llm, tiny_gqa, hf_model_cache, filters, seeded):
    temperature = 0.4
    torch.manual_seed(1234)
    params = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True, n=NUM_DRAWS,
                            seed=7 if seeded else None, **filters)
    draws = [c.token_ids[0] for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    logits = reference_logits(hf_model_cache, tiny_gqa, PROMPT, [0])[0]
    probs = reference_distribution(logits, temperature, **filters)
    allowed = set(probs.nonzero().flatten().tolist())
    assert 1 < len(allowed) < 200
    assert set(draws) <= allowed, f"drew {set(draws) - allowed}, outside the filtered set"
    assert chi_square_p_value(Counter(draws), probs, NUM_DRAWS) > 1e-3


def test_seeded_noise_is_exponential_and_unrelated_across_seeds_and_steps():
    seeds = torch.arange(64)
    noise = seeded_exponential(seeds, torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03  # Exp(1): 5 sigma
    for a, b in [(noise[:-1, 1:], noise[1:, :-1]), (noise, seeded_exponential(seeds, torch.ones(64, dtype=torch.int64),
                                                                              4096))]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01
    assert torch.equal(noise, seeded_exponential(seeds, torch.zeros(64, dtype=torch.int64), 4096))


def test_seed_reproduces_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=42, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([[9, 9, 9], PROMPT * 3, PROMPT, [1, 2]], [other, other, seeded, other], use_tqdm=False)
    reordered = llm.generate([PROMPT, [3] * 40], [seeded, other], use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone
    assert reordered[0].outputs[0].token_ids == alone
    different = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=43,
                                                      ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    state = SamplingState(num_slots=2, vocab_size=5, device=torch.device("cpu"))
    state.presence_penalty[1], state.frequency_penalty[1], state.repetition_penalty[1] = 0.25, 0.5, 2.0
    state.counts[1] = torch.tensor([IN_PROMPT, 1, 0, 2, 0])  # prompt: token 0; output: 1 once, 3 twice
    # repetition (tokens 0, 1, 3): 2 / 2 = 1, -1 * 2 = -2, 3 / 2 = 1.5; then
    # frequency x count (1: once, 3: twice) and presence (1, 3): -2 - 0.5 - 0.25, 1.5 - 1 - 0.25.
    assert process_native(logits, torch.tensor([1]), state).tolist() == [[1.0, -2.75, 0.5, 0.25, 1.0]]
    state.temperature[1] = 0.5
    assert process_native(logits, torch.tensor([1]), state).tolist() == [[2.0, -5.5, 1.0, 0.5, 2.0]]


def test_joined_slots_process_logits_as_transformers_processors_do():
    state = SamplingState(num_slots=8, vocab_size=300, device=torch.device("cpu"))
    check_processed_logits_match_transformers(process_native, state, 300, torch.device("cpu"))


def test_greedy_rows_and_padding_leave_the_noise_counter():
    sampler = Sampler(seed=0, num_slots=2, vocab_size=50)
    sampler.state.temperature[0] = 0.0
    counter = sampler.noise_counter.item()
    sampler(torch.randn(3, 50), torch.tensor([0, 2, 2]), NO_FILTER)  # 2: the scratch slot
    assert sampler.noise_counter.item() == counter
    sampler(torch.randn(2, 50), torch.tensor([1, 2]), NO_FILTER)
    assert sampler.noise_counter.item() == counter + 1


def test_each_step_records_its_tokens_for_the_next():
    """A greedy row samples token 7, then 8: the frequency penalty counts them, and the bad word [7, 8, 9]
    is banned only once both have been sampled."""
    from sampling_checks import join, running_sequences
    sampler = Sampler(seed=0, num_slots=2, vocab_size=50)
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    join(sampler.state, running_sequences([([1, 2], [], params, [[7, 8, 9]])]), torch.device("cpu"))
    slots = torch.tensor([0])
    for token in (7, 8):
        logits = torch.zeros(1, 50)
        logits[0, token] = 5.0
        assert sampler(logits, slots, NO_FILTER).tolist() == [token]
    scores = process_native(torch.zeros(1, 50), slots, sampler.state)
    assert scores[0, 7] == scores[0, 8] == -0.5 and scores[0, 9] == -torch.inf
    assert sampler.state.generated[0] == 2


def penalised_reference(logits: torch.Tensor, prompt, output, presence, frequency, repetition) -> torch.Tensor:
    logits = logits.double().clone()
    counts = Counter(output)
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token, count in counts.items():
        logits[token] -= frequency * count + presence
    return logits


def test_greedy_with_penalties_matches_a_hand_computation(llm, tiny_gqa, hf_model_cache):
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(completion)) > 8  # penalties keep the random model from repeating itself
    logits = reference_logits(hf_model_cache, tiny_gqa, PROMPT, completion)
    for pos, token in enumerate(completion):
        expected = penalised_reference(logits[pos], PROMPT, completion[:pos], 0.8, 0.6, 1.5)
        assert expected.max() - expected[token] < 1e-4, f"position {pos}"


def test_logprobs_match_transformers(llm, tiny_gqa, hf_model_cache):
    params = SamplingParams(temperature=0.8, max_tokens=10, logprobs=3, seed=5, ignore_eos=True)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    reference = torch.log_softmax(reference_logits(hf_model_cache, tiny_gqa, PROMPT, completion.token_ids).double(),
                                  dim=-1)
    assert len(completion.logprobs) == 10
    for pos, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = reference[pos].topk(3)
        for rank, (value, top_token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert position[top_token].rank == rank
            assert abs(position[top_token].logprob - value) < 1e-4
        assert abs(position[token].logprob - reference[pos, token].item()) < 1e-4
        assert position[token].rank == 1 + (reference[pos] > reference[pos, token]).sum().item()
        assert len(position) in (3, 4)
    expected_sum = sum(reference[pos, t].item() for pos, t in enumerate(completion.token_ids))
    assert abs(completion.cumulative_logprob - expected_sum) < 1e-3


def test_n_completions_prefill_the_prompt_once(llm, monkeypatch):
    prompt = list(range(100, 200))  # 6 full blocks of 16, then 4 tokens
    scheduled = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.extend(out.num_scheduled[out.num_decode:])  # prompt tokens, not decode tokens
        return out

    monkeypatch.setattr(llm.scheduler, "schedule", recording_schedule)
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The first completion computes all 100 prompt tokens; the others reuse its 96 cached ones.
    assert sorted(scheduled) == [4, 4, 4, 100]
    assert out.num_cached_tokens == 0
    again = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 96


@pytest.mark.parametrize("params, filter", [
    (dict(), "NO_FILTER"), (dict(temperature=0, top_p=0.9, top_k=500), "NO_FILTER"),
    (dict(top_k=20, top_p=0.95), "CANDIDATES"), (dict(top_k=64), "CANDIDATES"), (dict(min_p=0.1), "CANDIDATES"),
    (dict(min_p=0.1, top_k=5, top_p=0.5), "CANDIDATES"), (dict(top_k=65), "FULL_SORT"),
    (dict(top_p=0.9), "FULL_SORT"), (dict(min_p=0.1, top_p=0.9), "FULL_SORT"),
    (dict(top_k=100, top_p=0.9), "FULL_SORT"),
])
def test_a_step_takes_the_cheapest_filter_that_serves_every_row(params, filter):
    """The candidates (the 64 best scores) hold every kept token only under a top_k of at most 64, or min_p
    alone (whose cut is the row's maximum's); greedy rows take the argmax whatever their filters."""
    from nanovllm.engine.sampling_inputs import make_sampling_inputs
    from nanovllm.layers import sampler

    from sampling_checks import running_sequences
    plain, seq = running_sequences([([1], [], SamplingParams(temperature=0.7), []),
                                    ([1], [], SamplingParams(**{"temperature": 0.7, **params}), [])])
    inputs = make_sampling_inputs([plain, seq], [plain, seq], eos_token_ids={2})
    assert inputs.filter == getattr(sampler, filter)
    assert make_sampling_inputs([plain], [], eos_token_ids={2}).filter == sampler.NO_FILTER
