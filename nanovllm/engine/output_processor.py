from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


class OutputProcessor:
    """Turns sampled tokens into text: finds stop strings as they appear and builds the outputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.completion_token_ids,
                                     skip_special_tokens=seq.sampling_params.skip_special_tokens)

    def find_stop_string(self, seq: Sequence) -> tuple[str, str] | None:
        """The first stop string in seq's text and the text cut at it, or None. Checked after every
        token, so a string spread over several tokens is found as soon as its last piece arrives."""
        params = seq.sampling_params
        if not params.stop or seq.num_completion_tokens <= params.min_tokens:
            return None
        text = self.decode(seq)
        matches = [(text.find(stop), stop) for stop in params.stop if stop in text]
        if not matches:
            return None
        start, stop = min(matches)
        end = start + len(stop) if params.include_stop_str_in_output else start
        return stop, text[:end]

    def add_logprobs(self, seqs: list[Sequence], rows: list[list]):
        """Record each sampled sequence's step log-probabilities, from the sampler's per-row lists."""
        for seq, top_ids, top_logprobs, logprob, rank in zip(seqs, *rows):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            position: PositionLogprobs = {
                token: Logprob(lp, r + 1, self.tokenizer.decode([token]))
                for r, (token, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]))
            }
            position.setdefault(seq.last_token, Logprob(logprob, rank, self.tokenizer.decode([seq.last_token])))
            seq.logprobs.append(position)
            seq.cumulative_logprob += logprob

    def request_output(self, request_id: int, prompt: str | None, seqs: list[Sequence]) -> RequestOutput:
        completions = [self._completion(i, seq) for i, seq in enumerate(seqs)]
        return RequestOutput(request_id=str(request_id), prompt=prompt,
                             prompt_token_ids=seqs[0].token_ids[:seqs[0].num_prompt_tokens], outputs=completions,
                             num_cached_tokens=max(seqs[0].num_prompt_cache_hits, 0),
                             finished=all(seq.is_finished for seq in seqs))

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        wants_logprobs = seq.sampling_params.logprobs is not None
        return CompletionOutput(
            index=index,
            text=self.decode(seq) if seq.output_text is None else seq.output_text,
            token_ids=seq.completion_token_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=seq.logprobs if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
