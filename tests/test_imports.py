import subprocess
import sys

import pytest
import torch

from nanovllm.utils.checkpoint import write_random_checkpoint


def test_import_needs_neither_flash_attn_nor_triton():
    # None in sys.modules makes any import of these names fail, as on a machine without them.
    code = ("import sys; sys.modules['flash_attn'] = None; sys.modules['triton'] = None\n"
            "from nanovllm import LLM, SamplingParams\n"
            "import nanovllm.engine.model_runner, nanovllm.layers.attention\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_needs_no_ray():
    """Ray is an optional extra: nanovllm.ray imports it only when a processor runs."""
    code = ("import sys; sys.modules['ray'] = None; sys.modules['pyarrow'] = None\n"
            "import nanovllm, nanovllm.ray, nanovllm.run_batch\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# Compiler machinery a new engine must not import: it costs every new process (a Ray replica, run_batch) 1 s of
# its start on the H200 machine, 5.5 s where torch's bytecode is not cached. The first call of any torch custom op
# (flash-attn's Python wrappers are some) imports all three.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "sympy")

START_AND_GENERATE = """
import sys
from transformers import AutoConfig, AutoTokenizer

model, device = sys.argv[1:]
AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
if "torch._dynamo" in sys.modules:
    sys.exit("transformers' config or tokenizer imports torch._dynamo itself")
from nanovllm import LLM, SamplingParams
block_size = 256 if device == "cuda" else 16
with LLM(model, device=device, kvcache_block_size=block_size, max_model_len=512, max_num_seqs=8) as llm:
    llm.generate([[1, 2, 3] * 50, "the model reads"], SamplingParams(max_tokens=8, logprobs=2), use_tqdm=False)
print("imported:", *(m for m in {modules} if m in sys.modules))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_engine_starts_and_generates_without_torchs_compiler(tiny_gqa, tmp_path, device):
    model = tiny_gqa
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        # flash-attn's heads: bf16, head_dim 128
        model = write_random_checkpoint(str(tmp_path), torch.bfloat16, head_dim=128, hidden_size=256)
    code = START_AND_GENERATE.format(modules=COMPILER_MODULES)
    run = subprocess.run([sys.executable, "-c", code, model, device], capture_output=True, text=True)
    if "imports torch._dynamo itself" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "imported:"
