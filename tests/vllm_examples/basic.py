"""As vLLM's basic/basic.py: LLM(model=...), then generate() with one SamplingParams, at module level."""
from nanovllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is"]
params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model="TINY_MODEL")
for output in llm.generate(prompts, params):
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
