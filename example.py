"""Generate from a Qwen3 checkpoint: `python example.py --model ~/huggingface/Qwen3-0.6B/`.

With no --model, a tiny random-weight Qwen3 checkpoint is written once into a cache folder and used,
so the example runs on any machine, with no download (its text is gibberish: the weights are random).
"""
import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a folder with a Hugging Face Qwen3 checkpoint")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    path = os.path.expanduser(args.model) if args.model else tiny_checkpoint()

    with LLM(path, enforce_eager=True, tensor_parallel_size=args.tensor_parallel_size) as llm:
        sampling_params = SamplingParams(temperature=0.6, max_tokens=256 if args.model else 32)
        questions = ["introduce yourself", "list all prime numbers within 100"]
        conversations = [[{"role": "user", "content": q}] for q in questions]
        outputs = llm.chat(conversations, sampling_params)
    for output in outputs:
        print(f"\nPrompt: {output.prompt!r}\nCompletion: {output.outputs[0].text!r}")

if __name__ == "__main__":
    main()
