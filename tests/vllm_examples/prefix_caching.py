"""As vLLM's prefix_caching.py: an engine, `del` and cleanup_dist_env_and_memory() (nanovllm.distributed),
then a second engine with enable_prefix_caching=True in the same process, warmed up on one prompt of a
shared prefix; greedy texts with and without the cache compared."""
from nanovllm import LLM, SamplingParams
from nanovllm.distributed import cleanup_dist_env_and_memory

prefix = "You are an expert school principal, skilled in managing faculty and staff. Draft questions for a teacher: "
prompts = [prefix + p for p in ("Hello, my name is", "The capital of France is", "The future of AI is")]
params = SamplingParams(temperature=0.0)


def main():
    regular_llm = LLM(model="TINY_MODEL", gpu_memory_utilization=0.4)
    regular = [out.outputs[0].text for out in regular_llm.generate(prompts, params)]
    del regular_llm
    cleanup_dist_env_and_memory()
    cached_llm = LLM(model="TINY_MODEL", enable_prefix_caching=True, gpu_memory_utilization=0.4)
    cached_llm.generate(prompts[0], params)
    cached = [out.outputs[0].text for out in cached_llm.generate(prompts, params)]
    print(f"Generated answers are the same: {regular == cached}")


if __name__ == "__main__":
    main()
