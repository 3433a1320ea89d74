from nanovllm.engine.sequence import Sequence


class StopChecker:
    """Decides, after each new token, whether a sequence is finished and why (vLLM's order).

    Below min_tokens nothing but the length limits ends a sequence. Then, in turn: the end-of-sequence
    token (unless ignore_eos) gives ("stop", None); a stop token id gives ("stop", id); a stop string
    gives ("stop", string) and cuts the text at it (or after it, with include_stop_str_in_output);
    max_model_len or max_tokens give ("length", None). Stop strings are looked for in the text each
    token adds, through the sequence's incremental detokenizer.
    """

    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def reaches_length_limit(self, seq: Sequence) -> bool:
        """Whether seq's tokens, pending ones included, already fill max_tokens or max_model_len."""
        return self._at_length_limit(seq, seq.num_completion_tokens, len(seq))

    def _at_length_limit(self, seq: Sequence, num_completion_tokens: int, num_tokens: int) -> bool:
        return num_completion_tokens >= seq.sampling_params.max_tokens or num_tokens >= self.max_model_len

    def check(self, seq: Sequence) -> tuple[str, int | str | None] | None:
        """Called as each sampled token arrives (a later one may already be pending)."""
        params, token, num_completion_tokens = seq.sampling_params, seq.last_token, seq.num_known_completion_tokens
        new_text = seq.detokenizer.add(token) if seq.detokenizer else ""
        if num_completion_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            stop = self._find_stop_string(seq, new_text)
            if stop is not None:
                return "stop", stop
        if self._at_length_limit(seq, num_completion_tokens, len(seq.token_ids)):
            return "length", None
        return None

    @staticmethod
    def _find_stop_string(seq: Sequence, new_text: str) -> str | None:
        """The stop string that the new text completes first; the text is cut there."""
        params = seq.sampling_params
        if not params.stop or not new_text:
            return None
        text = seq.detokenizer.text
        first_start = len(text) - len(new_text) + 1  # a match must end in the new text
        matches = [(i, stop) for stop in params.stop if (i := text.find(stop, max(0, first_start - len(stop)))) >= 0]
        if not matches:
            return None
        start, stop = min(matches)
        seq.detokenizer.text = text[:start + len(stop) if params.include_stop_str_in_output else start]
        return stop
