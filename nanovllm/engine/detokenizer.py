class IncrementalDetokenizer:
    """A completion's text, grown one token at a time.

    Decoding tokens one by one breaks multi-byte characters and the spacing that depends on the
    token before. So, as vLLM does, each new token is decoded together with a few tokens before it
    (from `prefix_offset`) and the text they gave without it (up to `read_offset`) is cut off. Text
    that still ends in an incomplete character (U+FFFD) waits for the next token.
    """

    CONTEXT = 5  # prompt tokens decoded ahead of the first completion token

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completed (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
