from nanovllm.engine.sequence import Sequence


class StopChecker:
    """Decides, on tokens alone, whether a sequence is finished and why, after each new token (vLLM's core).

    Once the completion may end (`SamplingParams.may_stop`: past min_tokens), in turn: the end-of-sequence
    token (unless ignore_eos) gives ("stop", None) and a stop token id ("stop", id); then max_model_len
    or max_tokens give ("length", None). Stop strings are text: the output processor finds them.
    """

    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def set_token_limit(self, seq: Sequence):
        """The tokens seq may reach, prompt included: its max_tokens or max_model_len, whichever comes first."""
        seq.max_num_tokens = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)

    def check(self, seq: Sequence) -> tuple[str, int | None] | None:
        """Called as each sampled token arrives (a later one may already be pending)."""
        params, token_ids = seq.sampling_params, seq.token_ids
        token = token_ids[-1]
        is_eos = not params.ignore_eos and token in self.eos_token_ids
        # may_stop last: it is asked only of the few tokens that could stop the completion.
        if (is_eos or token in params.stop_token_ids) and params.may_stop(len(token_ids) - seq.num_prompt_tokens):
            return ("stop", None) if is_eos else ("stop", token)
        if len(token_ids) >= seq.max_num_tokens:
            return "length", None
        return None
