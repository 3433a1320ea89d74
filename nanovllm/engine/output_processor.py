from itertools import repeat

from nanovllm.engine.detokenizer import IncrementalDetokenizer, final_text
from nanovllm.engine.request import CompletionState, Request
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SampledLogprobs
from nanovllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from nanovllm.sampling_params import RequestOutputKind


class OutputProcessor:
    """Turns the tokens each step gives into vLLM's RequestOutputs: their text, where stop strings end it,
    their log-probabilities, and what each step returns (vLLM's split: the scheduler stops on tokens).

    A completion's text is decoded once, when its request finishes, unless it is needed token by
    token (stop strings, or outputs at every step): such completions carry an incremental detokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)

    def add_request(self, request: Request):
        params = request.params
        request.detokenizes_per_token = params.detokenize and bool(
            params.stop or params.output_kind != RequestOutputKind.FINAL_ONLY)
        if request.detokenizes_per_token:
            for completion in request.completions:
                completion.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                                params.skip_special_tokens, params.stop,
                                                                params.include_stop_str_in_output)

    def add_tokens(self, requests: list[Request], seqs: list[Sequence],
                   logprobs: SampledLogprobs | None) -> list[tuple[Sequence, str]]:
        """Take each sequence's newest token into its completion (a row of `logprobs` each, where given);
        returns the sequences whose text a stop string ends, with the string."""
        stops = []
        for request, seq, row in zip(requests, seqs, zip(*logprobs.columns()) if logprobs else repeat(None)):
            if row is None and not request.detokenizes_per_token:
                continue  # nothing of it to keep before it finishes
            completion = request.completion(seq)
            if row is not None and seq.sampling_params.logprobs is not None:
                self._add_logprobs(completion, seq, row)
            if completion.detokenizer is not None:
                # A sequence the scheduler stopped on EOS or a stop token id looks for no stop string.
                may_stop = seq.finish_reason != "stop" and seq.sampling_params.may_stop(seq.num_known_completion_tokens)
                stop = completion.detokenizer.add(seq.last_token, may_stop)
                if stop is not None:
                    stops.append((seq, stop))
        return stops

    def _add_logprobs(self, completion: CompletionState, seq: Sequence, row: tuple):
        """The position's top k and its sampled token (unless among them), into the completion's flat lists."""
        top_ids, top_logprobs, logprob, rank = row
        k, token = seq.sampling_params.logprobs, seq.last_token
        token_ids, logprobs, ranks = top_ids[:k], top_logprobs[:k], list(range(1, len(top_ids[:k]) + 1))
        if token not in token_ids:
            token_ids, logprobs, ranks = token_ids + [token], logprobs + [logprob], ranks + [rank]
        texts = self.token_texts
        completion.logprobs.append_position(token_ids, logprobs, ranks, [texts[t] for t in token_ids])
        completion.cumulative_logprob += logprob

    def add_prompt_logprobs(self, scored: list[tuple[Request | None, Sequence, int, int]], logprobs: SampledLogprobs):
        """Record the scored prompt positions' log-probabilities: (request, sequence, first position, count)
        as the step scored them (request None: it is gone), `logprobs` a row per position, in the same
        order. A prompt computed again (after preemption, or by another of the request's sequences) is
        recorded once."""
        position_rows = zip(*logprobs.columns())
        for request, seq, start, count in scored:
            for position in range(start + 1, start + 1 + count):
                top_ids, top_logprobs, logprob, rank = next(position_rows)
                if request is not None and position == len(request.prompt_logprobs):
                    k = request.params.prompt_logprobs
                    request.prompt_logprobs.append(self._position_logprobs(seq.token_ids[position], top_ids[:k],
                                                                           top_logprobs[:k], logprob, rank))

    def _position_logprobs(self, token: int, top_ids: list[int], top_logprobs: list[float], logprob: float,
                           rank: int) -> PositionLogprobs:
        """The top tokens' Logprobs (ranks from 1) and the chosen token's."""
        texts = self.token_texts
        position: PositionLogprobs = {t: Logprob(lp, r, texts[t])
                                      for r, (t, lp) in enumerate(zip(top_ids, top_logprobs), start=1)}
        if token not in position:
            position[token] = Logprob(logprob, rank, texts[token])
        return position

    def step_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs that requests which progressed this step are due, by their output_kind."""
        outputs, final_only, delta = [], RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA  # (slow lookups)
        for request in requests:
            kind = request.params.output_kind
            if kind is final_only and not request.finished:
                continue
            outputs.append(self.request_output(request, delta=kind is delta))
        return outputs

    def request_output(self, request: Request, delta: bool = False) -> RequestOutput:
        completions = [self._completion(i, seq, completion, delta)
                       for i, (seq, completion) in enumerate(zip(request.seqs, request.completions))]
        wants_prompt_logprobs = request.params.prompt_logprobs is not None
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions,
                             num_cached_tokens=max(request.seqs[0].num_cached_tokens, 0),
                             finished=request.finished, metrics=request.metrics,
                             prompt_logprobs=request.prompt_logprobs if wants_prompt_logprobs else None)

    def _completion(self, index: int, seq: Sequence, completion: CompletionState, delta: bool) -> CompletionOutput:
        wants_logprobs = seq.sampling_params.logprobs is not None
        text, token_ids, logprobs = self._text_so_far(seq, completion), seq.completion_token_ids, completion.logprobs
        if delta:
            sent_tokens, sent_chars = completion.num_sent_tokens, completion.num_sent_chars
            completion.num_sent_tokens, completion.num_sent_chars = len(token_ids), len(text)
            text, token_ids, logprobs = text[sent_chars:], token_ids[sent_tokens:], logprobs[sent_tokens:]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=completion.cumulative_logprob if wants_logprobs else None,
            logprobs=logprobs if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _text_so_far(self, seq: Sequence, completion: CompletionState) -> str:
        """The text to show: while a sequence runs, the tail that a stop string may still complete
        (and so cut) is held back, as in vLLM."""
        text, stop = self.text(seq, completion), seq.sampling_params.stop
        if seq.is_finished or not stop:
            return text
        return text[:max(0, len(text) - max(map(len, stop)) + 1)]

    def text(self, seq: Sequence, completion: CompletionState) -> str:
        if not seq.sampling_params.detokenize:
            return ""
        if completion.detokenizer is not None:
            return completion.detokenizer.text
        return final_text(self.tokenizer, seq.token_ids, seq.num_prompt_tokens, seq.sampling_params.skip_special_tokens)


class TokenTexts(dict):
    """A Logprob's decoded_token by token id, decoded once: a tokenizer.decode costs microseconds, and a
    step with log-probabilities asks for several per row."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id])
        return text
