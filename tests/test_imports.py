import subprocess
import sys


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
