"""benchmarks/dataset_paths.py's baseline: the script a user would run instead of a dataset path writes each row's
completion as generate gives it."""
import json

from benchmarks import dataset_paths
from nanovllm import LLM, SamplingParams

ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=256)


def test_the_script_writes_each_rows_completion(tiny_gqa, monkeypatch, tmp_path):
    dataset = [{"id": i, "prompt": [5 + i, 6, 7, 8], "sampling_params": {"temperature": 0, "max_tokens": 3 + i,
                                                                       "ignore_eos": True}} for i in range(3)]
    written = tmp_path / "out.jsonl"
    monkeypatch.setattr(dataset_paths.tempfile, "TemporaryDirectory", lambda: _Keep(tmp_path))
    assert dataset_paths.script_seconds(tiny_gqa, ENGINE_ARGS, dataset) > 0
    lines = [json.loads(line) for line in written.read_text().splitlines()]
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        outputs = llm.generate([row["prompt"] for row in dataset],
                               [SamplingParams(**row["sampling_params"]) for row in dataset], use_tqdm=False)
    assert lines == [{"id": i, "generated_text": out.outputs[0].text, "num_generated_tokens": 3 + i}
                     for i, out in enumerate(outputs)]


class _Keep:
    """A TemporaryDirectory that leaves its folder for the test to read."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        return self.path

    def __exit__(self, *exc_info):
        return False
