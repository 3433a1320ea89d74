"""As vLLM's llm_engine_example.py: LLMEngine.from_engine_args(EngineArgs.from_cli_args(args)), then
add_request() one prompt a step while step() runs (logprobs and prompt logprobs, top-k with a presence
penalty, n=2 with top-p and a frequency penalty), printing each finished RequestOutput."""
from nanovllm import EngineArgs, LLMEngine, SamplingParams
from nanovllm.utils import FlexibleArgumentParser


def run(args):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    pending = [("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
               ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
               ("What is the meaning of life?",
                SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1))]
    request_id = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, params = pending.pop(0)
            engine.add_request(str(request_id), prompt, params)
            request_id += 1
        for output in engine.step():
            if output.finished:
                print(output)


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="the LLMEngine step loop")
    parser = EngineArgs.add_cli_args(parser)
    run(parser.parse_args())
