"""As vLLM's basic/chat.py: `parser = EngineArgs.add_cli_args(parser)` (it returns the parser), sampling
flags with SamplingParams' defaults deleted from the namespace, LLM(**vars(args)), then chat() with one
conversation, a batch of them and a chat template read from a file."""
from nanovllm import LLM, EngineArgs, SamplingParams
from nanovllm.utils import FlexibleArgumentParser

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k")


def run(args):
    template_path = args.chat_template_path
    del args.chat_template_path
    params = SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    for name in SAMPLING_FLAGS:
        delattr(args, name)
    llm = LLM(**vars(args))
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hello! How can I assist you today?"},
                    {"role": "user", "content": "Write an essay about the importance of higher education."}]
    print([out.outputs[0].text for out in llm.chat(conversation, params, use_tqdm=False)])
    print(len(llm.chat([conversation] * 4, params, use_tqdm=True)), "conversations")
    if template_path:
        with open(template_path) as f:
            print(len(llm.chat([conversation] * 2, params, use_tqdm=False, chat_template=f.read())), "templated")


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    defaults = SamplingParams()
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.set_defaults(model="TINY_MODEL")
    parser.add_argument("--chat-template-path", type=str, default=None)
    run(parser.parse_args())
