"""A pooling engine's requests (`LLM(..., runner="pooling")`, then `LLM.embed`): each prompt is prefilled, in
chunks where it is long, and its last token's hidden state (the model runner's `_pool`, on the device) becomes its
embedding: cut to `dimensions` where asked, then normalised to unit length unless `use_activation=False`."""
import math

from nanovllm.engine.request import Request
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.outputs import EmbeddingOutput, EmbeddingRequestOutput
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import RequestOutputKind, SamplingParams


def pooling_sampling_params(params: PoolingParams) -> SamplingParams:
    """What the scheduler and input processor see of a pooling request: a prompt that ends in one step's row."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                          truncate_prompt_tokens=params.truncate_prompt_tokens)


def check_pooling_params(params, hf_config) -> PoolingParams:
    """params (None: the defaults) checked against the model: `dimensions` only where it is a Matryoshka model."""
    params = PoolingParams() if params is None else params
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams or a list of them, got {type(params).__name__}")
    if params.dimensions is not None:
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        allowed = params.dimensions in listed if listed else (getattr(hf_config, "is_matryoshka", False)
                                                              and params.dimensions <= hf_config.hidden_size)
        if not allowed:
            raise ValueError(f"dimensions={params.dimensions}: the model does not support Matryoshka embeddings of "
                             f"that size (its config lists matryoshka_dimensions={listed}, is_matryoshka="
                             f"{getattr(hf_config, 'is_matryoshka', False)}, hidden_size={hf_config.hidden_size})")
    return params


def pooled_outputs(scheduler: Scheduler, request_of_seq: dict[int, Request], scheduled: SchedulerOutput,
                   pooled: list[list[float]]) -> tuple[list[Request], list[EmbeddingRequestOutput]]:
    """A pooled step's requests, finished, and their outputs."""
    rows = scheduler.finish_pooled(scheduled)
    requests = [request_of_seq[scheduled.sampled[row].seq_id] for row in rows]
    return requests, [embedding_output(request, pooled[row]) for request, row in zip(requests, rows)]


def embedding_output(request: Request, hidden_state: list[float]) -> EmbeddingRequestOutput:
    params = request.pooling_params or PoolingParams()  # add_request() on a pooling engine: the defaults
    embedding = hidden_state[:params.dimensions] if params.dimensions else hidden_state
    if params.normalize:
        norm = max(math.sqrt(math.fsum(x * x for x in embedding)), 1e-12)  # F.normalize's floor
        embedding = [x / norm for x in embedding]
    return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(embedding), request.prompt_token_ids)
