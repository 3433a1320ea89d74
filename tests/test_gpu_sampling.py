"""The sampler on CUDA: its Triton kernels and its CUDA graphs against PyTorch and float64 references, over
Qwen3's vocabulary.

The graph's samples equal an eager race given the same noise, under filters a full sort in float64 decides;
filtered draws follow the full-sort distribution (Pearson); a seeded row draws the same token at any row of
any batch; the processed logits match transformers' logits processors; and a seeded request gives the same
tokens at any window and any place in its batch.
"""
from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams

from gpu_helpers import BASE, random_prompts
from sampling_checks import (
    check_processed_logits_match_transformers,
    chi_square_p_value,
    join,
    reference_distribution,
    running_sequences,
)

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

VOCAB = 151936
CUDA = torch.device("cuda")

# Rows of every filter the graphs take (CANDIDATES) and a top_p alone (a full sort, outside the graphs).
GRAPH_ROWS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=5, seed=11),
    SamplingParams(temperature=0.9, top_k=64, top_p=0.5, min_p=0.01, presence_penalty=0.5, logit_bias={7: 4.0}),
]
SORTED_ROWS = [SamplingParams(temperature=0.6, top_p=0.7), SamplingParams(temperature=1.0, top_p=0.95, seed=3)]


def make_sampler(rows: list[SamplingParams]):
    from nanovllm.layers.sampler import Sampler
    with torch.device(CUDA):
        sampler = Sampler(seed=0, num_slots=len(rows), vocab_size=VOCAB)
    join(sampler.state, running_sequences([([1, 2, 3], [4, 5], p, []) for p in rows]), CUDA)
    return sampler, torch.arange(len(rows), device=CUDA)


def peaked_logits(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(CUDA).manual_seed(seed)
    return torch.randn(num_rows, VOCAB, device=CUDA, generator=generator) * 4  # float32: ties at a cut are rare


def reference_tokens(sampler, logits, slots, rows: list[SamplingParams]) -> list[int]:
    """The race in float64 over the tokens a full sort keeps, on the noise the kernel is about to draw."""
    from nanovllm.kernels.sampling import exponential_noise
    from nanovllm.layers.sampler import process_native
    scores = process_native(logits, slots, sampler.state).double()
    noise = exponential_noise(slots, sampler.state, sampler.noise_counter, VOCAB).double()
    tokens = []
    for row, params in enumerate(rows):
        if params.temperature == 0:
            tokens.append(scores[row].argmax().item())
            continue
        probs = reference_distribution(scores[row], 1.0, params.top_k, params.top_p, params.min_p)
        tokens.append(torch.where(probs > 0, probs.log() - noise[row].log(), -torch.inf).argmax().item())
    return tokens


def test_processed_logits_match_transformers_logits_processors():
    from nanovllm.kernels.sampling import process
    from nanovllm.layers.sampling_state import SamplingState
    check_processed_logits_match_transformers(process, SamplingState(8, VOCAB, CUDA), VOCAB, CUDA)


def test_graph_samples_equal_an_eager_float64_race_given_the_same_noise():
    """Five replays of the captured sampler (state, counts and counter moving on each), and a full-sort step
    outside the graph, token for token against the reference."""
    from nanovllm.layers.sampler import CANDIDATES, FULL_SORT
    sampler, slots = make_sampler(GRAPH_ROWS)
    logits = peaked_logits(len(GRAPH_ROWS), seed=1)
    sampler(logits, slots, CANDIDATES)  # compiles, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = sampler(logits, slots, CANDIDATES)
    for step in range(5):
        logits.copy_(peaked_logits(len(GRAPH_ROWS), seed=10 + step))
        expected = reference_tokens(sampler, logits, slots, GRAPH_ROWS)
        counter = sampler.noise_counter.item()
        graph.replay()
        assert tokens.tolist() == expected, f"replay {step}"
        assert sampler.noise_counter.item() == counter + 1
    assert sampler.state.generated[:len(GRAPH_ROWS)].tolist() == [2 + 6] * len(GRAPH_ROWS)
    sorted_sampler, sorted_slots = make_sampler(SORTED_ROWS)
    logits = peaked_logits(len(SORTED_ROWS), seed=2)
    expected = reference_tokens(sorted_sampler, logits, sorted_slots, SORTED_ROWS)
    assert sorted_sampler(logits, sorted_slots, FULL_SORT).tolist() == expected


@pytest.mark.parametrize("rows, filter", [(GRAPH_ROWS[1:5], "CANDIDATES"), (SORTED_ROWS, "FULL_SORT")])
def test_filtered_draws_follow_the_full_sort_distribution(rows, filter):
    """3,000 draws per row against vLLM's filters by a full sort in float64, from logits of unit variance
    with 60 tokens raised by about 6 (most of the mass, spread over enough cells for the test; the
    cut falls among them, or in the tail for top_p=0.95)."""
    from nanovllm.layers import sampler as sampler_module
    sampler, slots = make_sampler(rows)
    logits = peaked_logits(len(rows), seed=3) / 4
    raised = torch.randperm(VOCAB, device=CUDA)[:60]
    logits[:, raised] += 6 + torch.rand(len(rows), 60, device=CUDA)
    draws = torch.stack([sampler(logits, slots, getattr(sampler_module, filter)) for _ in range(3000)]).cpu()
    for row, params in enumerate(rows):
        probs = reference_distribution(logits[row].float() / params.temperature, 1.0, params.top_k, params.top_p,
                                       params.min_p)
        assert set(draws[:, row].tolist()) <= set(probs.nonzero().flatten().tolist())
        assert chi_square_p_value(Counter(draws[:, row].tolist()), probs, 3000) > 1e-3, f"row {row}: {params}"


def test_a_seeded_row_draws_the_same_token_at_any_row_of_any_batch():
    from nanovllm.layers.sampler import CANDIDATES
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    logits = peaked_logits(1, seed=4)
    tokens = []
    for batch_size, row in [(1, 0), (8, 5), (64, 63), (300, 17)]:
        params = [SamplingParams(temperature=1.0)] * batch_size
        params[row] = seeded
        sampler, slots = make_sampler(params)
        batch = peaked_logits(batch_size, seed=5)
        batch[row] = logits[0]
        tokens.append([sampler(batch, slots, CANDIDATES)[row].item() for _ in range(6)])
    assert all(t == tokens[0] for t in tokens), tokens
    assert len(set(tokens[0])) > 1  # six draws, not one draw six times


def test_a_seeded_request_gives_the_same_tokens_at_any_window_and_place_in_its_batch(qwen3_checkpoint):
    """Seeded top-k/top-p sampling through the engine's graphs at max_model_len 4,096 and 40,960, at two
    places in a batch of eight."""
    seeded_prompt, *others_prompts = random_prompts([30, 200, 75, 9, 410, 64, 120, 333], seed=7)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True)
    completions = []
    for max_model_len in (4096, 40960):
        with LLM(qwen3_checkpoint, **{**BASE, "max_model_len": max_model_len}) as llm:
            for place in (0, 5):
                params = [others] * 8
                params[place] = seeded
                order = others_prompts[:place] + [seeded_prompt] + others_prompts[place:]
                outputs = llm.generate(order, params, use_tqdm=False)
                completions.append(outputs[place].outputs[0].token_ids)
    assert all(c == completions[0] for c in completions), completions
