"""As vLLM's basic/generate.py: the engine's flags added to an argument group, a default model set on the
group, extra sampling flags popped before LLM(**args), and the model's default sampling params changed
field by field."""
from nanovllm import LLM, EngineArgs
from nanovllm.utils import FlexibleArgumentParser


def run(args: dict):
    overrides = {name: args.pop(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    llm = LLM(**args)
    params = llm.get_default_sampling_params()
    for name, value in overrides.items():
        if value is not None:
            setattr(params, name, value)
    for output in llm.generate(["Hello, my name is", "The future of AI is"], params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model="TINY_MODEL")
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    run(vars(parser.parse_args()))
