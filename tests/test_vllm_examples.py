"""The scripts of tests/vllm_examples/ (each makes the calls of one of vLLM's offline-inference examples),
each run as a user runs it: in a process of its own, on a tiny random checkpoint, on the CPU."""
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent / "vllm_examples"
CPU = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16"]


def run_example(name: str, model: str, tmp_path: Path, *args: str) -> str:
    """The example with TINY_MODEL made `model`, run from tmp_path; its standard output."""
    script = tmp_path / name
    script.write_text((EXAMPLES / name).read_text().replace("TINY_MODEL", model))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as in CI, also on a GPU machine
    done = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_basic(tiny_gqa, tmp_path):
    assert run_example("basic.py", tiny_gqa, tmp_path).count("Prompt: ") == 2


def test_generate_with_engine_args_on_a_group(tiny_gqa, tmp_path):
    out = run_example("generate.py", tiny_gqa, tmp_path, "--model", tiny_gqa, *CPU, "--max_tokens", "8")
    assert out.count("Generated text: ") == 2


def test_chat_with_sampling_flags_deleted(tiny_gqa, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    out = run_example("chat.py", tiny_gqa, tmp_path, *CPU, "--max-tokens", "8", "--chat-template-path", str(template))
    assert "4 conversations" in out and "2 templated" in out


def test_llm_engine_example(tiny_gqa, tmp_path):
    out = run_example("llm_engine_example.py", tiny_gqa, tmp_path, "--model", tiny_gqa, *CPU)
    assert out.count("RequestOutput(") == 3


def test_reset_prefix_cache_under_a_running_request(tiny_gqa, tmp_path):
    """The reset preempts the request, which computes again from its tokens: the same greedy tokens as an
    engine that never reset, and a prompt log-probability entry per prompt token."""
    from nanovllm import LLM, SamplingParams
    out = run_example("llm_engine_reset_kv.py", tiny_gqa, tmp_path, "--model", tiny_gqa, *CPU).splitlines()
    assert out[0] == "reset: True"
    prompt = "A robot may not injure a human being"
    with LLM(tiny_gqa, device="cpu", num_kvcache_blocks=64, kvcache_block_size=16) as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out[1] == f"{list(want.outputs[0].token_ids)} {len(want.prompt_token_ids)}"


def test_metrics(tiny_gqa, tmp_path):
    from transformers import AutoTokenizer
    lines = run_example("metrics.py", tiny_gqa, tmp_path).splitlines()
    values = dict(line.split(" = ") for line in lines if "(counter) = " in line or "(gauge) = " in line)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gqa)
    num_prompt_tokens = sum(len(tokenizer.encode(p)) for p in ("Hello, my name is", "The capital of France is"))
    assert values["vllm:prompt_tokens (counter)"] == str(num_prompt_tokens)
    assert values["vllm:num_requests_running (gauge)"] == "0"
    assert "vllm:e2e_request_latency_seconds (histogram) sum" in "\n".join(lines)


def test_simple_profiling_writes_a_trace(tiny_gqa, tmp_path):
    out = run_example("simple_profiling.py", tiny_gqa, tmp_path, str(tmp_path / "profile"))
    assert out.count("Prompt: ") == 2
    traces = list((tmp_path / "profile").glob("*.pt.trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0]) as f:
        assert any(event.get("name") == "aten::linear" for event in json.load(f)["traceEvents"])


def test_prefix_caching_with_cleanup_between_engines(tiny_gqa, tmp_path):
    assert "Generated answers are the same: True" in run_example("prefix_caching.py", tiny_gqa, tmp_path)


def test_model_default_sampling(tiny_gqa, tmp_path):
    model = shutil.copytree(tiny_gqa, tmp_path / "model")
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.3, "top_p": 0.8,
                                                              "top_k": 5}))
    out = run_example("default_sampling.py", str(model), tmp_path)
    assert "defaults: 0.3 0.8 5" in out and out.count("Prompt: ") == 2


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_a_test(name):
    assert f'"{name}"' in Path(__file__).read_text()
