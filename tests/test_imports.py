import subprocess
import sys


def test_import_needs_neither_flash_attn_nor_triton():
    # None in sys.modules makes any import of these names fail, as on a machine without them.
    code = ("import sys; sys.modules['flash_attn'] = None; sys.modules['triton'] = None\n"
            "from nanovllm import LLM, SamplingParams\n"
            "import nanovllm.engine.model_runner, nanovllm.layers.attention\n")
    subprocess.run([sys.executable, "-c", code], check=True)
