class IncrementalDetokenizer:
    """A completion's text, grown one token at a time, cut at the first stop string it completes.

    Decoding tokens one by one breaks multi-byte characters and the spacing that depends on the
    token before. So, as vLLM does, each new token is decoded together with a few tokens before it
    (from `prefix_offset`) and the text they gave without it (up to `read_offset`) is cut off. Text
    that still ends in an incomplete character (U+FFFD) waits for the next token. A stop string must
    end in the text a token adds; the text is cut before it, or after it with include_stop_str_in_output.
    `final_text` gives the same text in one decode, for a completion that needs none before it finishes.
    """

    CONTEXT = 5  # prompt tokens decoded ahead of the first completion token

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop, self.include_stop_str_in_output = stop, include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_id: int, may_stop: bool = True) -> str | None:
        """Append one token; returns the stop string its text completes (looked for where may_stop), if any."""
        new_text = self._new_text(token_id)
        self.text += new_text
        if not (may_stop and self.stop and new_text):
            return None
        first_start = len(self.text) - len(new_text) + 1  # a match must end in the new text
        matches = [(i, stop) for stop in self.stop if (i := self.text.find(stop, max(0, first_start - len(stop)))) >= 0]
        if not matches:
            return None
        start, stop = matches[0]  # the first of the list that matches, as vLLM's stop checker takes it
        self.text = self.text[:start + len(stop) if self.include_stop_str_in_output else start]
        return stop

    def _new_text(self, token_id: int) -> str:
        """The text token_id completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def final_text(tokenizer, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool) -> str:
    """A finished completion's text (`token_ids`: its prompt's, then its own), the same as the
    IncrementalDetokenizer grows it, and vLLM's: decoded after the same prompt tokens, and ending at its
    last token after which the text did not end in an unfinished character. The tokens after that never
    show, even one that finishes a character before it starts the next."""
    start = max(0, num_prompt_tokens - IncrementalDetokenizer.CONTEXT)
    prefix_text = tokenizer.decode(token_ids[start:num_prompt_tokens], skip_special_tokens=skip_special_tokens)
    end = len(token_ids)
    text = tokenizer.decode(token_ids[start:end], skip_special_tokens=skip_special_tokens)
    while end > num_prompt_tokens and text.endswith("\ufffd"):  # rare: a text that ends inside a character
        end -= 1
        text = tokenizer.decode(token_ids[start:end], skip_special_tokens=skip_special_tokens)
    return text[len(prefix_text):]
