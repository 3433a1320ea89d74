"""Ray Data rows embedded or classified: `nanovllm.ray`'s replica for task_type "embed" and "classify", as Ray's
`ray.data.llm` runs a vLLM pooling engine:

    processor = build_llm_processor(NanoVLLMProcessorConfig(model_source=PATH, task_type="embed"),
                                    preprocess=lambda row: {"prompt": row["text"]},
                                    postprocess=lambda row: {"text": row["prompt"], "embedding": row["embeddings"]})

A row holds "prompt" (a text or token ids), "tokenized_prompt" or "messages", and optionally "pooling_params" (a
dict of PoolingParams fields). As in Ray, "embeddings" holds a row's embedding, or a classifier's class
probabilities (its scores, with use_activation=False).
"""
from nanovllm.engine.pooling import pooled_values
from nanovllm.engine.request import Request
from nanovllm.entrypoints.requests import check_keys
from nanovllm.outputs import PoolingRequestOutput
from nanovllm.pooling_params import PoolingParams
from nanovllm.ray_rows import error_text, refuse_other_tasks_fields, row_prompt, to_python, with_columns

# Columns added to every row, with Ray's names; a row that fails has an error and nulls in the others.
POOLED_COLUMNS = ("embeddings", "num_input_tokens", "error")


class PoolingReplica:
    """One pooling engine (runner="pooling"), alive for the whole dataset. A batch's rows are made into requests,
    each checked once, and those that pass run together as one `embed` or `classify` call runs them: a bad row
    gets its error and stops no other. Batches that Ray hands over together are called one after another (the call
    does not await): a pooling request is one prefill, with no tail of decode steps that another batch's rows could
    fill."""

    def __init__(self, model: str, engine_kwargs: dict):
        from nanovllm import LLM

        self.llm = LLM(model, **engine_kwargs)

    async def __call__(self, batch):
        """[batch_size rows] pyarrow Table -> the same rows, in their order, with POOLED_COLUMNS added."""
        refuse_other_tasks_fields(batch, self.llm.config.convert)
        made = [self.request(row) for row in batch.to_pylist()]
        requests = [r for r in made if isinstance(r, Request)]
        with self.llm.guard:  # as embed() and classify() run their requests
            outputs = iter(self.llm._run(requests, use_tqdm=False) if requests else [])
        return with_pooled_columns(batch, [next(outputs) if isinstance(r, Request) else r for r in made])

    def request(self, row: dict) -> Request | Exception:
        """The row's request, checked as embed() or classify() checks its prompts; or the error that refuses it."""
        try:
            return self.llm.input_processor.make_request(self.llm._new_request_id(), row_prompt(self.llm, row),
                                                         row_pooling_params(row))
        except Exception as error:  # whatever a row's values make fail is that row's error, not the dataset's
            return error


def row_pooling_params(row: dict) -> PoolingParams:
    fields = to_python(row.get("pooling_params")) or {}
    if not isinstance(fields, dict):
        raise ValueError(f"pooling_params must be a dict of PoolingParams fields, got {type(fields).__name__}")
    # Arrow gives every row every key seen in the column; a missing one comes as None, PoolingParams' default.
    fields = {name: value for name, value in fields.items() if value is not None}
    check_keys("pooling_params", fields, PoolingParams.__dataclass_fields__)
    return PoolingParams(**fields)


def with_pooled_columns(batch, results: list[PoolingRequestOutput | Exception]):
    import pyarrow as pa

    def column(of_output, arrow_type):
        return pa.array([of_output(r) if isinstance(r, PoolingRequestOutput) else None for r in results], arrow_type)

    columns = {
        "embeddings": column(pooled_values, pa.list_(pa.float32())),
        "num_input_tokens": column(lambda o: len(o.prompt_token_ids), pa.int64()),
        "error": pa.array([None if isinstance(r, PoolingRequestOutput) else error_text(r) for r in results],
                          pa.string()),
    }
    return with_columns(batch, columns)
