"""As vLLM's llm_engine_reset_kv.py: the step loop of llm_engine_example.py with FlexibleArgumentParser from
nanovllm.utils.argparse_utils, and reset_prefix_cache(reset_running_requests=True) at step 10, while
the request runs."""
from nanovllm import EngineArgs, LLMEngine, SamplingParams
from nanovllm.utils.argparse_utils import FlexibleArgumentParser


def run(args):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    pending = [("A robot may not injure a human being",
                SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16))]
    step_id = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, params = pending.pop(0)
            engine.add_request("0", prompt, params)
        if step_id == 10:
            print("reset:", engine.reset_prefix_cache(reset_running_requests=True))
        for output in engine.step():
            if output.finished:
                print(output.outputs[0].token_ids, len(output.prompt_logprobs))
        step_id += 1


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="resetting the prefix cache under running requests")
    parser = EngineArgs.add_cli_args(parser)
    run(parser.parse_args())
