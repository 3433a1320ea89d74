"""A pooling engine's requests (`LLM(..., runner="pooling")`, then `LLM.embed` or `LLM.classify`): each prompt is
prefilled, in chunks where it is long, and its last token's hidden state (or its tokens' mean, or its first
token's: `layers/pooler.py`, on the device) becomes its embedding, cut to `dimensions` where asked, then
normalised to unit length; or, for a classifier, its scores become probabilities by a softmax.
`use_activation=False` leaves out the normalisation or the softmax."""
import functools
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm.engine.request import Request
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.inputs import is_single_prompt
from nanovllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import RequestOutputKind, SamplingParams
from nanovllm.utils.folder_checkpoint import read_json


def pooling_sampling_params(params: PoolingParams) -> SamplingParams:
    """What the scheduler and input processor see of a pooling request: a prompt that ends in one step's row."""
    return _sampling_params_truncated_to(params.truncate_prompt_tokens)


@functools.lru_cache(maxsize=64)
def _sampling_params_truncated_to(truncate_prompt_tokens: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                          truncate_prompt_tokens=truncate_prompt_tokens)


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


# sentence-transformers' Pooling modes, as vLLM's pooling types
SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}


def sentence_transformers_pooling(folder: str) -> str | None:
    """How a sentence-transformers folder says its model pools (modules.json names a Pooling module, whose
    config.json sets pooling_mode_*): one of POOLING_TYPES, None where it says nothing; another mode is refused."""
    try:
        with open(os.path.join(folder, "modules.json"), encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None
    modules = [module for module in modules if isinstance(module, dict)] if isinstance(modules, list) else []
    dense = [module for module in modules if str(module.get("type", "")).endswith("models.Dense")]
    if dense:
        raise ValueError(f"model {folder!r} projects its pooled state through a sentence-transformers Dense module "
                         f"({dense[0].get('path')!r}), which this engine does not apply")
    for module in modules:
        if str(module.get("type", "")).endswith("models.Pooling"):
            pooling = read_json(os.path.join(folder, str(module.get("path", "")), "config.json"))
            modes = [name.removeprefix("pooling_mode_") for name, on in pooling.items()
                     if name.startswith("pooling_mode_") and on is True]
            if len(modes) != 1 or modes[0] not in SENTENCE_TRANSFORMERS_MODES:
                raise ValueError(f"model {folder!r} pools by {' and '.join(modes) or 'no mode'} (its sentence-"
                                 f"transformers Pooling config); this engine pools by one of "
                                 f"{', '.join(SENTENCE_TRANSFORMERS_MODES)}")
            return SENTENCE_TRANSFORMERS_MODES[modes[0]]
    return None


def pooled_outputs(scheduler: Scheduler, request_of_seq: dict[int, Request], scheduled: SchedulerOutput,
                   pooled: np.ndarray, config) -> tuple[list[Request], list]:
    """A pooled step's requests, finished, and their outputs: embeddings, or a classifier's (config.convert)."""
    rows = scheduler.finish_pooled(scheduled)
    requests = [request_of_seq[scheduled.sampled[row].seq_id] for row in rows]
    if config.convert == "classify":
        return requests, [classification_output(r, pooled[row].tolist(), config.hf_config)
                          for r, row in zip(requests, rows)]
    return requests, [embedding_output(request, pooled[row]) for request, row in zip(requests, rows)]


def classification_output(request: Request, scores: list[float], hf_config) -> ClassificationRequestOutput:
    """As vLLM's classifier pooler: a softmax over two or more labels, a sigmoid of one (or of each, for
    multi-label problems), none for regression; none at all with use_activation=False."""
    params = request.pooling_params or PoolingParams()
    problem = getattr(hf_config, "problem_type", None)
    if params.use_activation is not False and problem != "regression":
        if len(scores) == 1 or problem == "multi_label_classification":
            scores = [1 / (1 + math.exp(-x)) for x in scores]
        else:
            top = max(scores)
            exps = [math.exp(x - top) for x in scores]
            total = math.fsum(exps)
            scores = [x / total for x in exps]
    return ClassificationRequestOutput(request.request_id, ClassificationOutput(scores), request.prompt_token_ids)


def embedding_output(request: Request, hidden_state: np.ndarray) -> EmbeddingRequestOutput:
    params = request.pooling_params or PoolingParams()  # add_request() on a pooling engine: the defaults
    embedding = torch.from_numpy(hidden_state[:params.dimensions] if params.dimensions else hidden_state)
    if params.normalize:
        embedding = F.normalize(embedding.double(), dim=0)
    return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(embedding.tolist()), request.prompt_token_ids)


def pooled_values(output: PoolingRequestOutput) -> list[float]:
    """An embedding's values, or a classifier's probabilities."""
    return output.outputs.probs if isinstance(output, ClassificationRequestOutput) else output.outputs.embedding


def score_sides(data_1, data_2) -> tuple[list, list]:
    """vLLM's pairings: one to one, one to many (data_1 alone), or many to many, pair by pair."""
    firsts, seconds = ([data] if is_single_prompt(data) else list(data) for data in (data_1, data_2))
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ValueError(f"score() pairs one data_1 with each data_2, or each data_1 with its data_2: got "
                         f"{len(firsts)} and {len(seconds)}")
    if not seconds:
        raise ValueError("score() needs at least one data_2")
    return firsts, seconds


def cosine_scores(firsts: list[EmbeddingRequestOutput], seconds: list[EmbeddingRequestOutput]):
    """Each pair's cosine (a lone first pairs with every second); vLLM's ids, the two requests' joined."""
    firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
    return [ScoringRequestOutput(f"{first.request_id}_{second.request_id}",
                                 ScoringOutput(cosine(first.outputs.embedding, second.outputs.embedding)),
                                 first.prompt_token_ids + second.prompt_token_ids)
            for first, second in zip(firsts, seconds)]


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(x * x for x in b))
    return math.fsum(x * y for x, y in zip(a, b)) / max(norms, 1e-12)


def pair_prompt(tokenizer, first, second) -> dict:
    """A cross-encoder's prompt of two texts, tokenized as a pair; of two token-id prompts, their ids joined."""
    if isinstance(first, str) and isinstance(second, str):
        return {"prompt_token_ids": tokenizer(first, second)["input_ids"]}
    ids = [prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt for prompt in (first, second)]
    if not all(isinstance(side, list) and all(isinstance(t, int) for t in side) for side in ids):
        raise ValueError("score() with a cross-encoder takes two texts, or two token-id prompts, a pair")
    return {"prompt_token_ids": ids[0] + ids[1]}


def cross_encoder_scores(outputs: list[ClassificationRequestOutput], use_activation: bool):
    """A one-label classifier's score of each pair, through a sigmoid unless use_activation is False."""
    def activated(x: float) -> float:
        return 1 / (1 + math.exp(-x)) if use_activation else x
    return [ScoringRequestOutput(output.request_id, ScoringOutput(activated(output.outputs.probs[0])),
                                 output.prompt_token_ids) for output in outputs]
