"""Ray Data over nano-vllm, shaped like Ray's own `ray.data.llm`:

    processor = build_llm_processor(NanoVLLMProcessorConfig(model_source=PATH, concurrency=2),
                                    preprocess=lambda row: {"prompt": row["text"],
                                                            "sampling_params": {"temperature": 0}})
    dataset = processor(ray.data.read_json(...))

Each of the `concurrency` replicas is one long-lived engine in a Ray actor (asking for
`tensor_parallel_size` GPUs when it runs on GPUs); Ray hands it `batch_size` rows at a time, up to
`max_concurrent_batches` batches at once, and does the distribution over nodes, the batching and the
back-pressure. The batches in a replica share its one running engine, so it never drains between them.
With `task_type="embed"` or `"classify"` the replicas are `ray_pooling.py`'s, which embed or classify the rows.
Install with `pip install -e ".[ray]"`; `import nanovllm` never imports ray.
"""
import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.entrypoints.requests import structured_outputs_params
from nanovllm.outputs import RequestOutput
from nanovllm.ray_pooling import PoolingReplica
from nanovllm.ray_rows import error_text, refuse_other_tasks_fields, row_prompt, to_python, with_columns
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams, final_only
from nanovllm.utils.frozen_heap import frozen_heap

# Columns added to every row; a row that fails has an error and nulls in the others.
GENERATED_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens", "error")
# Ray's task_types, and the engine each runs: vLLM's runner and convert, which engine_kwargs may only repeat.
TASK_ENGINE_KWARGS = {"generate": dict(runner="generate", convert="none"),
                      "embed": dict(runner="pooling", convert="embed"),
                      "classify": dict(runner="pooling", convert="classify")}


@dataclass
class NanoVLLMProcessorConfig:
    """model_source: the model folder, at the same path on every node.
    task_type: Ray's: "generate" text, "embed" rows (a generative checkpoint's last hidden state) or "classify"
        them (a *ForSequenceClassification checkpoint's class probabilities).
    engine_kwargs: `LLM` keyword arguments (`nanovllm.config.Config` fields), e.g. tensor_parallel_size.
    concurrency: engine replicas: n for a fixed pool, or (min, max) for one Ray scales between them.
    batch_size: rows handed to a replica at a time; each batch comes back when its own rows are done.
    max_concurrent_batches: batches a replica holds at once (vLLM's name), all in its one engine.
    num_cpus_per_replica: CPUs each replica asks for; on CPUs this is all it asks for.
    """

    model_source: str
    task_type: str = "generate"
    engine_kwargs: dict = field(default_factory=dict)
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 256  # faster than vLLM's 64 here (docs/benchmarks.md)
    max_concurrent_batches: int = 8
    num_cpus_per_replica: float = 1.0

    def __post_init__(self):
        if self.task_type not in TASK_ENGINE_KWARGS:
            raise ValueError(f"task_type must be one of {', '.join(TASK_ENGINE_KWARGS)}, got {self.task_type!r}")
        for name, value in TASK_ENGINE_KWARGS[self.task_type].items():
            given = self.engine_kwargs.get(name, "auto")
            if given not in ("auto", value):
                raise ValueError(f"engine_kwargs {name}={given!r} does not go with task_type={self.task_type!r}, "
                                 f"which runs the engine with {name}={value!r}: leave {name} out")


def build_llm_processor(config: NanoVLLMProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                        postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                        postprocess_map_kwargs: dict | None = None) -> "NanoVLLMProcessor":
    """A processor that maps a dataset whose rows hold "prompt" (a text or token ids), "tokenized_prompt" or
    "messages", and optionally "sampling_params" (a dict of SamplingParams fields; its "structured_outputs" a dict
    of StructuredOutputsParams fields or that dict's JSON text), to one with GENERATED_COLUMNS added; with
    task_type "embed" or "classify", optionally "pooling_params" in place of "sampling_params", to one with
    ray_pooling.POOLED_COLUMNS added.
    `preprocess` and `postprocess` map each row before and after (`Dataset.map`, with their map kwargs)."""
    return NanoVLLMProcessor(config, preprocess, postprocess, preprocess_map_kwargs or {}, postprocess_map_kwargs or {})


@dataclass
class NanoVLLMProcessor:
    config: NanoVLLMProcessorConfig
    preprocess: Callable[[dict], dict] | None
    postprocess: Callable[[dict], dict] | None
    preprocess_map_kwargs: dict
    postprocess_map_kwargs: dict
    replica_class: type = None  # NanoVLLMReplica or PoolingReplica; the tests put a failing one in its place

    def __post_init__(self):
        self.replica_class = self.replica_class or (
            NanoVLLMReplica if self.config.task_type == "generate" else PoolingReplica)

    def __call__(self, dataset):
        import ray.data

        config = self.config
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        sizes = (dict(size=config.concurrency) if isinstance(config.concurrency, int) else
                 dict(min_size=config.concurrency[0], max_size=config.concurrency[1]))
        in_flight = config.max_concurrent_batches
        pool = ray.data.ActorPoolStrategy(**sizes, max_tasks_in_flight_per_actor=in_flight,
                                          max_concurrent_calls_per_actor=in_flight)
        engine_kwargs = {**config.engine_kwargs, **TASK_ENGINE_KWARGS[config.task_type]}
        replica_kwargs = dict(model=config.model_source, engine_kwargs=engine_kwargs)
        dataset = dataset.map_batches(
            self.replica_class, fn_constructor_kwargs=replica_kwargs,
            batch_size=config.batch_size, batch_format="pyarrow", compute=pool, num_cpus=config.num_cpus_per_replica,
            num_gpus=num_gpus_per_replica(config.engine_kwargs))
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        return dataset


def num_gpus_per_replica(engine_kwargs: dict) -> int:
    """tensor_parallel_size on GPUs: device "cuda", or "auto" in a cluster that has GPUs; else 0."""
    import ray

    device = engine_kwargs.get("device", "auto")
    on_gpus = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return engine_kwargs.get("tensor_parallel_size", 1) if on_gpus else 0


class NanoVLLMReplica:
    """One engine, alive for the whole dataset. Ray Data runs its calls, a batch each, as coroutines on
    the replica's one event loop: each call adds its rows' requests to the running engine and waits for
    them, while one driver steps the engine as long as any row waits and lets new batches join between
    steps. A bad row gets its error at once and holds up no other."""

    def __init__(self, model: str, engine_kwargs: dict):
        from nanovllm import LLM

        self.llm = LLM(model, **engine_kwargs)
        self.waiting: dict[str, asyncio.Future] = {}
        self.request_ids = itertools.count()
        self.driver: asyncio.Task | None = None

    async def __call__(self, batch):
        """[batch_size rows] pyarrow Table -> the same rows, in their order, with GENERATED_COLUMNS added."""
        refuse_other_tasks_fields(batch, "generate")
        submitted = [self.submit(row) for row in batch.to_pylist()]
        try:
            results = [await r if isinstance(r, asyncio.Future) else r for r in submitted]
        except asyncio.CancelledError:  # Ray gave up on this batch: its rows leave the engine, the others stay
            mine = [request_id for request_id, future in self.waiting.items() if future in submitted]
            self.llm.abort_request(mine)
            for request_id in mine:
                self.waiting.pop(request_id).cancel()
            raise
        return with_generated_columns(batch, results)

    def submit(self, row: dict) -> asyncio.Future | Exception:
        """The row's request in the engine, and the future of its output; or the error that refused it."""
        request_id = f"row-{next(self.request_ids)}"
        try:
            params = final_only(row_sampling_params(row))
            self.llm.add_request(request_id, row_prompt(self.llm, row), params)
        except Exception as error:  # whatever a row's values make fail is that row's error, not the dataset's
            return error
        loop = asyncio.get_running_loop()
        self.waiting[request_id] = future = loop.create_future()
        if self.driver is None or self.driver.done():
            self.driver = loop.create_task(self.drive())
        return future

    async def drive(self):
        try:
            with frozen_heap():
                while self.waiting:
                    for output in self.llm.step():
                        future = self.waiting.pop(output.request_id, None)
                        if future is not None and not future.done():
                            future.set_result(output)
                    await asyncio.sleep(0)  # the loop's other calls add their batches here
        except BaseException as error:  # every waiting row fails with it; the engine drops their requests
            self.llm.abort_request(list(self.waiting))
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(error)
            raise
        finally:
            self.waiting.clear()


def row_sampling_params(row: dict) -> SamplingParams:
    fields = to_python(row.get("sampling_params")) or {}
    if not isinstance(fields, dict):
        raise ValueError(f"sampling_params must be a dict of SamplingParams fields, got {type(fields).__name__}")
    # Arrow gives every row every key seen in the column; a missing one comes as None, SamplingParams' default.
    fields = {name: value for name, value in fields.items() if value is not None}
    unknown = sorted(set(fields) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        raise ValueError(f"sampling_params has unknown field(s) {', '.join(unknown)}")
    if fields.get("n", 1) != 1:
        raise ValueError(f"n must be 1: a row holds one completion, got {fields['n']}")
    if isinstance(fields.get("logit_bias"), dict):
        fields["logit_bias"] = row_logit_bias(fields["logit_bias"])
    if "structured_outputs" in fields:
        fields["structured_outputs"] = row_structured_outputs(fields["structured_outputs"])
    return SamplingParams(**fields)


def row_logit_bias(bias: dict) -> dict:
    """logit_bias as JSON and Arrow hold it: token ids as texts (a struct's field names), and in every row every
    id the column has seen, None where the row has none."""
    return {int(token) if isinstance(token, str) and token.isascii() and token.isdigit() else token: value
            for token, value in bias.items() if value is not None}


def row_structured_outputs(value) -> StructuredOutputsParams:
    """structured_outputs as a row holds it: a dict of StructuredOutputsParams fields, or its JSON text. Arrow gives
    a dict every key its column has seen, None where the row has none, down into a JSON schema's own objects: so
    a dict's Nones are dropped at every depth, and a schema that needs a null goes as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs is not JSON: {error}") from None
        value = {name: v for name, v in value.items() if v is not None} if isinstance(value, dict) else value
    elif isinstance(value, dict):
        value = without_nulls(value)
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be a dict of StructuredOutputsParams fields or its JSON text, "
                         f"got {type(value).__name__}")
    return structured_outputs_params(value, "sampling_params' structured_outputs")


def without_nulls(value):
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return [without_nulls(v) for v in value] if isinstance(value, list) else value


def with_generated_columns(batch, results: list[RequestOutput | Exception]):
    import pyarrow as pa

    def column(of_output, arrow_type):
        return pa.array([of_output(r) if isinstance(r, RequestOutput) else None for r in results], arrow_type)

    columns = {
        "generated_text": column(lambda o: o.outputs[0].text, pa.string()),
        "generated_tokens": column(lambda o: o.outputs[0].token_ids, pa.list_(pa.int64())),
        "num_input_tokens": column(lambda o: len(o.prompt_token_ids), pa.int64()),
        "num_generated_tokens": column(lambda o: len(o.outputs[0].token_ids), pa.int64()),
        "error": pa.array([None if isinstance(r, RequestOutput) else error_text(r) for r in results], pa.string()),
    }
    return with_columns(batch, columns)
