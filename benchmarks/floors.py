"""A model's decode steps and prefill against their floors, on one GPU, for any architecture of REAL_DIMENSIONS:

- decode of B sequences (--batches): milliseconds a step (the difference of two generates of fresh 128-token
  prompts, 1 and 1 + N output tokens), against the bytes a step must read (every weight but the experts, the
  experts the batch is expected to touch, the KV cache; FP8 weights at a byte, an FP8 cache at a byte and its
  scales) at the H200's 4.8 TB/s;
- prefill of long prompts (--prefill): the matmul rate of a generate of one output token, against a large bf16
  matmul measured in the same process (and the H200's 989 TFLOPS of dense bf16);
- with --workload (no GPU, no checkpoint): a harness workload's floor, every decode step's bytes with all its
  sequences at once (as the engine runs a workload its cache holds) and its prompts, a cached prefix once, at
  989 TFLOPS (twice that with FP8 weights), in seconds and output tok/s.

    python -m benchmarks.floors --random-checkpoint /tmp/moe30 [--random-dims qwen3-30b-a3b] [--load-format dummy]
        [--batches 1,256] [--decode-steps 64] [--prefill 8x4000] [--kv-cache-dtype fp8] [--out FILE]
    python -m benchmarks.floors --workload bench --random-dims qwen3-30b-a3b-fp8
"""
import argparse
import json
import random
from time import perf_counter
from types import SimpleNamespace

import torch

from benchmarks.workloads import make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.engine.kv_cache import block_bytes
from nanovllm.models.decoder import attention_head_dim
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint

HBM_BYTES_PER_S = 4.8e12
DENSE_BF16_FLOPS = 989e12
PROMPT_LEN = 128


class Shapes:
    """The parameter counts a token reads, from a Hugging Face config."""

    def __init__(self, hf_config):
        c = hf_config
        self.layers, self.hidden = c.num_hidden_layers, c.hidden_size
        self.head_dim = attention_head_dim(c)
        self.kv_heads, self.q_heads = c.num_key_value_heads, c.num_attention_heads
        self.attention = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        self.num_experts = getattr(c, "num_experts", 0) or 0
        if self.num_experts:
            self.top_k, self.expert = c.num_experts_per_tok, 3 * self.hidden * c.moe_intermediate_size
            self.router = self.hidden * self.num_experts
        else:
            self.top_k, self.expert, self.router, self.num_experts = 1, 3 * self.hidden * c.intermediate_size, 0, 1
        self.vocab = c.vocab_size * self.hidden

    def touched_experts(self, batch: int) -> float:
        """Experts a layer is expected to read for `batch` tokens routed uniformly at random."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def decode_bytes(self, batch: int, context: int, weight_bytes: int = 2, kv_token_bytes: float | None = None
                     ) -> float:
        """The linears FP8 quantizes (attention, the MLP or the touched experts) at weight_bytes a parameter, the
        router and the LM head at bf16's 2 (a checkpoint's modules_to_not_convert), and kv_token_bytes of KV cache a
        token (bf16's unless given)."""
        linears = self.layers * (self.attention + self.touched_experts(batch) * self.expert)
        kv_token_bytes = kv_token_bytes or 2 * self.layers * 2 * self.kv_heads * self.head_dim
        return weight_bytes * linears + 2 * (self.layers * self.router + self.vocab) + batch * context * kv_token_bytes

    def prefill_flops(self, prompt_len: int) -> float:
        """A token's matmuls, and its causal attention over on average half its prompt."""
        per_layer = self.attention + self.router + self.top_k * self.expert
        scores = 2 * self.q_heads * self.head_dim * prompt_len / 2
        return 2 * self.layers * (per_layer + scores)


def fresh_prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10000) for _ in range(length)] for _ in range(n)]


def timed(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    torch.cuda.synchronize()
    start = perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return perf_counter() - start


def decode_ms(llm: LLM, batch: int, steps: int, rng: random.Random) -> float:
    timed(llm, fresh_prompts(batch, PROMPT_LEN, rng), 1 + steps)  # warm-up
    with_decode = timed(llm, fresh_prompts(batch, PROMPT_LEN, rng), 1 + steps)
    prefill_only = timed(llm, fresh_prompts(batch, PROMPT_LEN, rng), 1)
    return (with_decode - prefill_only) / steps * 1e3


def measured_matmul_flops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a @ b
    torch.cuda.synchronize()
    start = perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * n**3 / (perf_counter() - start)


def kv_token_bytes(config) -> float:
    """The KV cache's bytes a token as the engine allocates them (an FP8 cache's scales included)."""
    return block_bytes(config) / config.kvcache_block_size


def decode_report(llm: LLM, shapes: Shapes, batch: int, steps: int, rng: random.Random) -> dict:
    ms = decode_ms(llm, batch, steps, rng)
    weight_bytes = 1 if llm.config.quantization else 2  # every method served is FP8
    step_bytes = shapes.decode_bytes(batch, PROMPT_LEN + steps // 2, weight_bytes, kv_token_bytes(llm.config))
    floor_ms = step_bytes / HBM_BYTES_PER_S * 1e3
    return dict(ms_per_step=round(ms, 3), floor_ms=round(floor_ms, 3), share_of_floor=round(floor_ms / ms, 3),
                touched_experts=round(shapes.touched_experts(batch), 1))


def prefill_report(llm: LLM, shapes: Shapes, count: int, length: int, rng: random.Random) -> dict:
    timed(llm, fresh_prompts(count, length, rng), 1)  # warm-up
    seconds = timed(llm, fresh_prompts(count, length, rng), 1)
    flops = count * length * shapes.prefill_flops(length) / seconds
    matmul = measured_matmul_flops()
    return dict(prompts=count, tokens=length, tok_s=round(count * length / seconds), tflops=round(flops / 1e12, 1),
                matmul_tflops=round(matmul / 1e12, 1), share_of_matmul=round(flops / matmul, 3),
                share_of_989=round(flops / DENSE_BF16_FLOPS, 3))


def uncached_lens(prompts: list[list[int]], block_size: int = 256) -> list[int]:
    """Each prompt's tokens past its leading full blocks that an earlier prompt already holds (prefix caching,
    the engine's default block size)."""
    seen, lens = set(), []
    for prompt in prompts:
        blocks = [tuple(prompt[:end]) for end in range(block_size, len(prompt) + 1, block_size)]
        cached = next((i for i, block in enumerate(blocks) if block not in seen), len(blocks)) * block_size
        seen.update(blocks)
        lens.append(len(prompt) - cached)
    return lens


def workload_floor(shapes: Shapes, name: str, weight_bytes: int) -> dict:
    """The seconds and output tok/s that workload `name` cannot beat on the H200 (with a bf16 KV cache)."""
    workload = make_workload(name)
    if workload.num_gpus != 1:
        raise ValueError(f"workload {name!r} runs on {workload.num_gpus} GPUs; the floor counts one")
    prompt_lens, output_lens = [len(prompt) for prompt in workload.prompts], list(workload.max_tokens)
    decode_s = 0.0
    for step in range(1, max(output_lens)):  # a sequence's first output token comes with its prompt
        contexts = [length + step for length, outputs in zip(prompt_lens, output_lens) if outputs > step]
        decode_s += shapes.decode_bytes(len(contexts), sum(contexts) / len(contexts), weight_bytes) / HBM_BYTES_PER_S
    flops = DENSE_BF16_FLOPS * (2 if weight_bytes == 1 else 1)
    computed = uncached_lens(workload.prompts)
    prefill_s = sum(shapes.prefill_flops(length) * new for length, new in zip(prompt_lens, computed)) / flops
    return dict(workload=name, decode_s=decode_s, prefill_s=prefill_s, floor_s=decode_s + prefill_s,
                out_tok_per_s=sum(output_lens) / (decode_s + prefill_s))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", metavar="DIR")
    parser.add_argument("--random-dims", default="qwen3-30b-a3b", choices=sorted(REAL_DIMENSIONS))
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill", default="8x4000", help="prompts x tokens")
    parser.add_argument("--workload", help="only this harness workload's floor, computed here (no GPU)")
    parser.add_argument("--out", help="a JSON file for the figures")
    args = parser.parse_args()
    if args.workload:
        if args.kv_cache_dtype != "auto":
            parser.error("--workload counts the bf16 cache alone")
        dims = REAL_DIMENSIONS[args.random_dims]
        weight_bytes = 1 if "quantization_config" in dims else 2
        floor = workload_floor(Shapes(SimpleNamespace(**dims)), args.workload, weight_bytes)
        return print(json.dumps({key: round(value, 2) if isinstance(value, float) else value
                                 for key, value in floor.items()}))
    if not args.random_checkpoint:
        parser.error("--random-checkpoint is needed unless --workload")
    path = random_checkpoint(args.random_checkpoint, args.random_dims, weights=args.load_format != "dummy")
    llm = LLM(path, load_format=args.load_format, max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype)
    shapes, rng, report = Shapes(llm.config.hf_config), random.Random(0), {"dims": args.random_dims}
    for batch in map(int, args.batches.split(",")):
        report[f"decode_{batch}"] = decode_report(llm, shapes, batch, args.decode_steps, rng)
        print(json.dumps({f"decode_{batch}": report[f"decode_{batch}"]}), flush=True)
    report["prefill"] = prefill_report(llm, shapes, *map(int, args.prefill.split("x")), rng)
    print(json.dumps({"prefill": report["prefill"]}), flush=True)
    llm.exit()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
