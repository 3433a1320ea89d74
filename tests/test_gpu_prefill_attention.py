"""The Triton prompt attention on CUDA against flash-attn's varlen kernel (same inputs, bf16), new prompts and
chunks continuing a cached prefix through the block table, at real head sizes; and an engine whose prompts it serves
gives the tokens flash-attn's engine gives."""
import pytest
import torch

from nanovllm import LLM, SamplingParams

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytestmark = pytest.mark.gpu

from gpu_helpers import TOLERANCE, assert_same_greedy  # noqa: E402 (after the skip: it needs a GPU's packages)


def varlen_inputs(q_lens, prefixes, num_heads, num_kv_heads, head_dim, block_size=256):
    torch.manual_seed(0)
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    q = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    blocks = [-(-n // block_size) for n in k_lens]
    k_cache, v_cache = (torch.randn(sum(blocks) + 2, block_size, num_kv_heads, head_dim, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    table = torch.full((len(k_lens), max(blocks)), -1, dtype=torch.int32, device="cuda")
    order = torch.randperm(sum(blocks) + 2, device="cuda")[:sum(blocks)].to(torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[start:start + n]
        start += n
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for lens in (q_lens, k_lens)]
    return q, k_cache, v_cache, table, cu, k_lens


def float32_reference(q, k_all, v_all, table, q_lens, k_lens) -> torch.Tensor:
    """Causal attention in float32 per sequence (the trimmed flash-attn build has no head size of 256): keys through
    the block table where one is given, else by token."""
    out, start, key_start = torch.empty(q.shape, device=q.device), 0, 0
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        keys = torch.arange(k_len, device=q.device)
        if table is not None:
            rows = table[i, keys // k_all.size(1)].long(), keys % k_all.size(1)
        else:
            rows = (key_start + keys,)
        key_start += k_len
        k, v = (c[rows].float().transpose(0, 1) for c in (k_all, v_all))  # [kv_heads, k_len, d]
        group = q.size(1) // k.size(0)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q[start:start + q_len].float().transpose(0, 1) @ k.transpose(1, 2) * q.size(-1) ** -0.5
        visible = keys[None, :] <= (k_len - q_len + torch.arange(q_len, device=q.device))[:, None]
        out[start:start + q_len] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        start += q_len
    return out


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(128, 16, 8), (64, 32, 8), (256, 8, 4)])
@pytest.mark.parametrize("paged", [False, True])
def test_prefill_attention_matches_flash_attn(head_dim, num_heads, num_kv_heads, paged):
    pytest.importorskip("flash_attn")
    from nanovllm.kernels.flash_attn import varlen_attention
    from nanovllm.kernels.prefill_attention import prefill_attention
    q_lens, prefixes = [1, 300, 2500, 77], ([0, 512, 256, 1300] if paged else [0] * 4)  # 2,500: the long tiles
    q, k_cache, v_cache, table, (cu_q, cu_k), k_lens = varlen_inputs(q_lens, prefixes, num_heads, num_kv_heads,
                                                                      head_dim)
    if paged:
        args = (q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5, table)
    else:
        k, v = (c.view(-1, num_kv_heads, head_dim)[:sum(k_lens)].contiguous() for c in (k_cache, v_cache))
        args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5)
    got = prefill_attention(*args).float()
    want = varlen_attention(*args).float() if head_dim <= 128 else float32_reference(
        q, args[1], args[2], table if paged else None, q_lens, k_lens)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_an_engine_without_flash_attn_gives_its_tokens(qwen3_checkpoint, qwen3_reference, monkeypatch):
    pytest.importorskip("flash_attn")
    from nanovllm.kernels import flash_attn
    prompts = [[(5 * i + j) % 500 + 1 for j in range(20 + 130 * i)] for i in range(6)]  # up to 670 tokens
    again = [prompts[5][:600] + [1, 2, 3]]  # two cached blocks of 256: the paged path
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = []
    for flash_attn_module in (flash_attn.flash_attn_2_cuda, None):  # installed, then as if it were not
        monkeypatch.setattr(flash_attn, "flash_attn_2_cuda", flash_attn_module)
        monkeypatch.setattr(flash_attn, "before_hopper", lambda device: True)  # flash-attn serves on any GPU
        # 512-token chunks: the longer prompts continue their first chunk through the block table too
        with LLM(qwen3_checkpoint, max_model_len=1024, gpu_memory_utilization=0.3, max_num_batched_tokens=512) as llm:
            outputs.append(llm.generate(prompts, params, use_tqdm=False) + llm.generate(again, params, use_tqdm=False))
            assert outputs[-1][-1].num_cached_tokens == 512
    prompts += again
    for flash, triton_ in zip(*outputs):  # the first token's log-probability: the prompt's attention alone
        a, b = flash.outputs[0], triton_.outputs[0]
        assert abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][b.token_ids[0]].logprob) < 0.05
    flash_tokens, triton_tokens = ([list(output.outputs[0].token_ids) for output in run] for run in outputs)
    assert_same_greedy(qwen3_reference, prompts, triton_tokens, flash_tokens, "without flash-attn")


@pytest.mark.parametrize("engine_args, margin", [(dict(kvcache_block_size=32), TOLERANCE),
                                                 (dict(dtype="float32"), 0.01)], ids=["blocks-of-32", "float32"])
def test_what_flash_attn_cannot_serve_runs_through_the_triton_kernel(qwen3_checkpoint, qwen3_reference, engine_args,
                                                                     margin):
    """A cache in blocks of 32 (flash-attn reads blocks of 256n) and float32 (flash-attn has none): greedy tokens
    within the near-tie margin of transformers' float32 (bf16's, or float32's own), through chunks and a prefix hit."""
    prompts = [[(5 * i + j) % 500 + 1 for j in range(20 + 130 * i)] for i in range(6)]
    again = [prompts[5][:600] + [1, 2, 3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(qwen3_checkpoint, max_model_len=1024, gpu_memory_utilization=0.3, max_num_batched_tokens=512,
             **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(again, params, use_tqdm=False)
        assert outputs[-1].num_cached_tokens >= 512
    for prompt, output in zip(prompts + again, outputs):
        assert qwen3_reference.max_deficit(prompt, output.outputs[0].token_ids) < margin
