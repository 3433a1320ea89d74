"""A workload that fills the KV cache: long decodes at a 40,960-token window, more requests than the cache holds.
How many sequences run at once, and the output tokens a second they give, with the model's dtype in the cache or
`--kv-cache-dtype fp8`; each a new process.

    python -m benchmarks.kv_capacity --random-checkpoint /tmp/q06 --kv-cache-dtype fp8

--num-requests requests of --prompt-len random token ids each ask for the rest of the window (ignore_eos,
temperature 0.6): none finishes within the run. The engine steps until the prompts it admitted fill 95% of the
cache, then on for --seconds, timed (decodes, and the preempted sequences' prompts again as the cache fills);
printed: the cache's size in tokens, the sequences running (`vllm:num_requests_running`: their mean and peak
over the timed steps), preemptions, and the output tokens a second of the timed steps.
"""
import argparse
import random
import time

from nanovllm import LLM, RequestOutputKind, SamplingParams
from nanovllm.utils.checkpoint import random_checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", metavar="DIR", required=True,
                        help="a random bf16 Qwen3-0.6B-sized checkpoint, written into DIR unless it holds one")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=20, help="seconds of decoding timed")
    return parser.parse_args()


def gauge(llm: LLM, name: str) -> float:
    return next(metric.value for metric in llm.get_metrics() if metric.name == name)


def main():
    args = parse_args()
    path = random_checkpoint(args.random_checkpoint)
    llm = LLM(path, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.executor.model_runner
    cache_tokens = runner.num_kvcache_blocks * llm.scheduler.block_manager.block_size
    rng, top_id = random.Random(0), min(10000, llm.config.hf_config.vocab_size - 1)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.max_model_len - args.prompt_len,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(args.num_requests):
        llm.add_request(str(i), [rng.randint(0, top_id) for _ in range(args.prompt_len)], params)
    while gauge(llm, "vllm:kv_cache_usage_perc") < 0.95 and gauge(llm, "vllm:num_requests_waiting"):
        llm.step()  # the prompts the cache admits
    running, tokens, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        tokens += sum(len(output.outputs[0].token_ids) for output in llm.step())
        running.append(gauge(llm, "vllm:num_requests_running"))
    seconds = time.perf_counter() - start
    print(f"kv_cache_dtype={args.kv_cache_dtype}: the cache holds {cache_tokens:,} tokens; running sequences "
          f"mean {sum(running) / len(running):.1f}, peak {max(running):.0f}; preemptions "
          f"{gauge(llm, 'vllm:num_preemptions'):.0f}; {tokens / seconds:,.0f} output tok/s over {seconds:.1f} s "
          f"of {len(running)} steps")
    llm.exit()


if __name__ == "__main__":
    main()
