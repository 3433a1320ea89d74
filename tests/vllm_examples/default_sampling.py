"""As vLLM's basic/basic_with_model_default_sampling.py (its quickstart): LLM(..., generation_config="auto"),
whose get_default_sampling_params() come from the model's generation_config.json; "vllm" gives vLLM's."""
from nanovllm import LLM

llm = LLM(model="TINY_MODEL", generation_config="auto")
params = llm.get_default_sampling_params()
print("defaults:", params.temperature, params.top_p, params.top_k)
for output in llm.generate(["Hello, my name is", "The capital of France is"], params):
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
