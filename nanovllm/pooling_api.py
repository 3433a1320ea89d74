"""`LLM`'s pooling methods, vLLM's: `embed`, `classify` and `score`, on an engine made with `runner="pooling"`
(`engine/pooling.py` makes their outputs)."""
import dataclasses

import torch

from nanovllm.engine.input_processor import Prompt, check_defaults_only
from nanovllm.engine.pooling import (
    cosine_scores,
    cross_encoder_scores,
    pair_prompt,
    pooled_values,
    score_sides,
)
from nanovllm.engine.request import Request
from nanovllm.inputs import is_single_prompt
from nanovllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from nanovllm.pooling_params import PoolingParams

POOLING_TASKS = ("embed", "classify")  # vLLM's pooling tasks this engine serves


class PoolingAPI:
    """Mixed into `LLM`, whose engine runs the requests these methods make."""

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """vLLM's: the embedding of each prompt (a text, token ids or a dict, alone or in a list), on an engine
        made with `runner="pooling"`: its last token's hidden state, normalised unless `use_activation=False`.
        `pooling_params` is one PoolingParams for all prompts or a list, one per prompt; `truncate_prompt_tokens`
        overrides theirs. Every prompt is checked before any work starts."""
        check_defaults_only(lora_request)
        self._check_pools("embed", "embed()")
        with self.guard:
            return self._run(self._pooling_requests(prompts, pooling_params, truncate_prompt_tokens), use_tqdm)

    def classify(self, prompts: Prompt | list[Prompt],
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
                 lora_request=None) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (`.outputs.probs`; the scores themselves with
        `use_activation=False`), from a *ForSequenceClassification checkpoint's score head on its last token."""
        check_defaults_only(lora_request)
        self._check_pools("classify", "classify()")
        with self.guard:
            return self._run(self._pooling_requests(prompts, pooling_params, None), use_tqdm)

    def encode(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
               *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request=None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's: each prompt's pooled values for `pooling_task` ("embed" or "classify", the engine's), as a
        tensor (`.outputs.data`): what embed() or classify() give, as `PoolingOutput`s."""
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"encode() needs pooling_task, one of {', '.join(map(repr, POOLING_TASKS))}, got "
                             f"{pooling_task!r} (per-token tasks such as 'token_embed' are not supported)")
        if pooling_task == "embed":
            outputs = self.embed(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)
        else:
            if truncate_prompt_tokens is not None:
                raise ValueError("encode(pooling_task='classify') takes truncate_prompt_tokens in its PoolingParams")
            outputs = self.classify(prompts, pooling_params, use_tqdm, lora_request)
        return [PoolingRequestOutput(output.request_id, PoolingOutput(torch.tensor(pooled_values(output))),
                                     output.prompt_token_ids) for output in outputs]

    def score(self, data_1: str | list[str], data_2: str | list[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request=None) -> list[ScoringRequestOutput]:
        """vLLM's: a score per pair, one data_1 to each data_2 or pair by pair: for an embedding engine the cosine
        of their embeddings; for a classifier of one label (a cross-encoder) the sigmoid of its score of the two
        texts tokenized as a pair (its raw score with `use_activation=False`)."""
        check_defaults_only(lora_request)
        self._check_runner("pooling", "score()")
        firsts, seconds = score_sides(data_1, data_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if self.config.convert == "embed":
            embeddings = self.embed(firsts + seconds, params, use_tqdm=use_tqdm)
            return cosine_scores(embeddings[:len(firsts)], embeddings[len(firsts):])
        if self.config.hf_config.num_labels != 1:
            raise ValueError(f"score() with a classifier needs one label (a cross-encoder); this model has "
                             f"{self.config.hf_config.num_labels}: use classify()")
        firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
        pairs = [pair_prompt(self.tokenizer, first, second) for first, second in zip(firsts, seconds)]
        raw = dataclasses.replace(params, use_activation=False)
        return cross_encoder_scores(self.classify(pairs, raw, use_tqdm), params.use_activation is not False)

    def _pooling_requests(self, prompts, pooling_params, truncate_prompt_tokens: int | None) -> list[Request]:
        if is_single_prompt(prompts):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if not isinstance(pooling_params, list | tuple) or len(pooling_params) != len(prompts):
            raise ValueError(f"pooling_params must be a PoolingParams or a list of them, one per prompt; got "
                             f"{type(pooling_params).__name__} for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            pooling_params = [dataclasses.replace(params or PoolingParams(),
                                                  truncate_prompt_tokens=truncate_prompt_tokens)
                              if isinstance(params, PoolingParams | None) else params for params in pooling_params]
        return [self.input_processor.make_request(self._new_request_id(), prompt,
                                                  PoolingParams() if params is None else params, i)
                for i, (prompt, params) in enumerate(zip(prompts, pooling_params))]

    def _check_runner(self, runner: str, method: str):
        if self.config.runner != runner:
            other = "embed() or classify()" if runner == "generate" else "generate() or chat()"
            raise ValueError(f"{method} needs an engine made with runner={runner!r}; this one has runner="
                             f"{self.config.runner!r}, for {other}: make another, LLM(model, runner={runner!r})")

    def _check_pools(self, convert: str, method: str):
        self._check_runner("pooling", method)
        if self.config.convert != convert:
            raise ValueError(f"{method} needs convert={convert!r}; this engine has convert={self.config.convert!r}"
                             f" ({'a *ForSequenceClassification checkpoint' if convert == 'classify' else 'embed()'})")
