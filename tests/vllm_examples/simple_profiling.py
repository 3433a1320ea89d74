"""As vLLM's simple_profiling.py: LLM(..., profiler_config={"profiler": "torch", "torch_profiler_dir": ...}),
then start_profile(), generate() and stop_profile(). The directory is this script's first argument."""
import sys

from nanovllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model="TINY_MODEL", tensor_parallel_size=1,
              profiler_config={"profiler": "torch", "torch_profiler_dir": sys.argv[1]})
    llm.start_profile()
    outputs = llm.generate(["Hello, my name is", "The future of AI is"], SamplingParams(temperature=0.8, top_p=0.95))
    llm.stop_profile()
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
