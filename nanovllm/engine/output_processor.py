from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.request import Request
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SampledLogprobs
from nanovllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from nanovllm.sampling_params import RequestOutputKind


class OutputProcessor:
    """Turns sequences into vLLM's RequestOutputs: their text, log-probabilities, and what each step returns.

    A completion's text is decoded once, when its request finishes, unless it is needed token by
    token (stop strings, or outputs at every step): such sequences carry an incremental detokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def attach_detokenizers(self, request: Request):
        params = request.params
        if params.detokenize and (params.stop or params.output_kind != RequestOutputKind.FINAL_ONLY):
            for seq in request.seqs:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         params.skip_special_tokens)

    def add_logprobs(self, seqs: list[Sequence], logprobs: SampledLogprobs):
        """Record each sequence's log-probabilities for its newest token, one row of `logprobs` each."""
        for seq, top_ids, top_logprobs, logprob, rank in zip(seqs, *logprobs.columns()):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            seq.logprobs.append(self._position_logprobs(seq.last_token, top_ids[:k], top_logprobs[:k], logprob, rank))
            seq.cumulative_logprob += logprob

    def add_prompt_logprobs(self, rows: list[tuple[int, int, int]], scheduled, logprobs: SampledLogprobs):
        """Record the scored prompt positions' log-probabilities: `rows` as scored_prompts gives them,
        `logprobs` a row per scored position, in the same order. A prompt computed again (after
        preemption) is recorded once."""
        position_rows = iter(zip(*logprobs.columns()))
        for i, start, count in rows:
            seq = scheduled.seqs[i]
            k = seq.sampling_params.prompt_logprobs
            for position in range(start + 1, start + 1 + count):
                top_ids, top_logprobs, logprob, rank = next(position_rows)
                if position == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(self._position_logprobs(seq.token_ids[position], top_ids[:k],
                                                                       top_logprobs[:k], logprob, rank))

    def _position_logprobs(self, token: int, top_ids: list[int], top_logprobs: list[float], logprob: float,
                           rank: int) -> PositionLogprobs:
        """The top tokens' Logprobs (ranks from 1) and the chosen token's."""
        position: PositionLogprobs = {t: Logprob(lp, r + 1, self.tokenizer.decode([t]))
                                      for r, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        position.setdefault(token, Logprob(logprob, rank, self.tokenizer.decode([token])))
        return position

    def step_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs that requests which progressed this step are due, by their output_kind."""
        outputs = []
        for request in requests:
            kind = request.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not request.finished:
                continue
            outputs.append(self.request_output(request, delta=kind == RequestOutputKind.DELTA))
        return outputs

    def request_output(self, request: Request, delta: bool = False) -> RequestOutput:
        completions = [self._completion(i, seq, request, delta) for i, seq in enumerate(request.seqs)]
        wants_prompt_logprobs = request.params.prompt_logprobs is not None
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions,
                             num_cached_tokens=max(request.seqs[0].num_prompt_cache_hits, 0),
                             finished=request.finished, metrics=request.metrics,
                             prompt_logprobs=request.seqs[0].prompt_logprobs if wants_prompt_logprobs else None)

    def _completion(self, index: int, seq: Sequence, request: Request, delta: bool) -> CompletionOutput:
        wants_logprobs = seq.sampling_params.logprobs is not None
        text, token_ids, logprobs = self._text_so_far(seq), seq.completion_token_ids, seq.logprobs
        if delta:
            sent_tokens, sent_chars = request.num_sent[index]
            request.num_sent[index] = (len(token_ids), len(text))
            text, token_ids, logprobs = text[sent_chars:], token_ids[sent_tokens:], logprobs[sent_tokens:]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=logprobs if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _text_so_far(self, seq: Sequence) -> str:
        """The text to show: while a sequence runs, the tail that a stop string may still complete
        (and so cut) is held back, as in vLLM."""
        text, stop = self.text(seq), seq.sampling_params.stop
        if seq.is_finished or not stop:
            return text
        return text[:max(0, len(text) - max(map(len, stop)) + 1)]

    def text(self, seq: Sequence) -> str:
        if not seq.sampling_params.detokenize:
            return ""
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        skip_special_tokens = seq.sampling_params.skip_special_tokens
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=skip_special_tokens)
