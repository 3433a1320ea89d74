"""Structured outputs on CUDA: constrained rows masked between the decode graph and the sampler graph sample
what the eager engine samples, and every output satisfies its constraint (`jsonschema`, `re.fullmatch`)."""
import json
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.gpu

RECORD = {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["kind", "n", "ok"]}
DIGITS = r"[0-9]{2,6}-[a-f]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]


def requests(num: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Every fourth request free, the others under a schema, a regex or a choice, greedy and seeded."""
    constraints = [None, dict(json=RECORD, disable_any_whitespace=True), dict(regex=DIGITS), dict(choice=CHOICES)]
    prompts, params = [], []
    for i in range(num):
        constraint = constraints[i % 4]
        prompts.append([(7 * i + j) % 400 + 1 for j in range(5 + i % 23)])
        params.append(SamplingParams(
            temperature=0 if i % 3 == 0 else 0.9, seed=i, max_tokens=48, logprobs=2 if i % 5 == 0 else None,
            structured_outputs=StructuredOutputsParams(**constraint) if constraint else None))
    return prompts, params


def assert_valid(text: str, params: SamplingParams):
    constraint = params.structured_outputs
    if constraint is None:
        return
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    else:
        assert text in constraint.choice


# Up to 40 rows the graphs and the eager engine compute the same bf16 logits; at 130 their batches split
# differently into steps and matmul shapes, where a random model's near-ties may part: outputs still hold.
@pytest.mark.parametrize("num, same_tokens", [(3, True), (40, True), (130, False)])
def test_masked_graphs_sample_as_the_eager_engine_and_every_output_holds(qwen3_checkpoint, num, same_tokens):
    prompts, params = requests(num)
    outputs = {}
    for enforce_eager in (False, True):
        with LLM(qwen3_checkpoint, enforce_eager=enforce_eager, max_model_len=256, gpu_memory_utilization=0.3,
                 max_num_seqs=128) as llm:
            outputs[enforce_eager] = llm.generate(prompts, params, use_tqdm=False)
    for graph, eager, request in zip(outputs[False], outputs[True], params):
        assert graph.outputs[0].token_ids == eager.outputs[0].token_ids or not same_tokens
        for output in (graph, eager):
            if output.outputs[0].finish_reason == "stop":
                assert_valid(output.outputs[0].text, request)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_device_mask_is_xgrammars(rows):
    """The bitmask applied on the GPU leaves what xgrammar's own CPU function leaves, on a vocabulary that is
    not a multiple of 32."""
    import xgrammar

    from nanovllm.layers.sampler import apply_token_bitmask
    vocab = 49157
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows + 3, vocab, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    masked_rows = torch.arange(rows) + 2  # rows 0, 1 and the last but one of the logits stay whole
    expected = logits.clone()
    part = expected[masked_rows]
    xgrammar.apply_token_bitmask_inplace(part, bitmask)
    expected[masked_rows] = part
    on_gpu = logits.cuda().bfloat16()
    apply_token_bitmask(on_gpu, masked_rows.cuda(), bitmask.cuda())
    assert torch.equal(on_gpu.isinf().cpu(), expected.isinf())
    assert torch.equal(on_gpu.float().cpu()[~expected.isinf()], logits.bfloat16().float()[~expected.isinf()])
