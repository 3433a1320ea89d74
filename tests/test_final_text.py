"""One request, one final text, whatever its output kind, and vLLM's: on SmolLM2's byte-level vocabulary,
texts that end inside a character, against the UTF-8 decode of the tokens' bytes."""

import pytest

from nanovllm import LLM, RequestOutputKind, SamplingParams
from nanovllm.utils.checkpoint import write_random_checkpoint
from nanovllm.utils.gguf_checkpoint import load_tokenizer

from conftest import smollm2_file

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, dtype="float32", device="cpu")

# SmolLM2 tokens by the bytes they stand for: pieces of multi-byte characters, a space with the start of
# "—" (e2 80 94), and whole characters followed by the start of another.
SMOLLM2_TOKEN_BYTES = {81: b"a", 142: b"\xc3", 119: b"\xa9", 173: b"\xe2", 218: b"\x80", 238: b"\x94",
                       459: b" \xe2\x80", 28532: b"\xd7\x99\xd7", 10003: b"\xd0\xbe\xd0"}


def vllm_final_text(token_ids: list[int]) -> str:
    """vLLM's incremental detokenizer shows new text only at a token after which the text does not end in an
    unfinished character (U+FFFD), so a finished completion's text is the decode of its tokens up to the
    last such token: an unfinished tail is left out, with any whole characters in the tokens it spans."""
    for end in range(len(token_ids), -1, -1):
        text = b"".join(SMOLLM2_TOKEN_BYTES[t] for t in token_ids[:end]).decode("utf-8", errors="replace")
        if not text.endswith("\ufffd"):
            return text


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """A tiny random model over SmolLM2's vocabulary, with SmolLM2's tokenizer (from its GGUF file)."""
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("smollm2_vocabulary")), vocab_size=49152)
    load_tokenizer(smollm2_file()).save_pretrained(path)
    with LLM(path, **ENGINE_ARGS) as engine:
        yield engine


def test_the_final_text_is_the_same_for_every_output_kind(smollm2):
    """Sampled from the tokens above, 1 to 6 of them: texts that end inside a character, some with a whole
    character or a space in the token that starts it. Each seed runs as every output kind, in one batch."""
    def params(i, kind):
        return SamplingParams(temperature=1.0, seed=i, max_tokens=1 + i % 6, ignore_eos=True, output_kind=kind,
                              allowed_token_ids=list(SMOLLM2_TOKEN_BYTES))
    prompt, num = "The word is", 24
    for i in range(num):
        smollm2.add_request(f"cumulative {i}", prompt, params(i, RequestOutputKind.CUMULATIVE))
        smollm2.add_request(f"delta {i}", prompt, params(i, RequestOutputKind.DELTA))
    final = smollm2.generate([prompt] * num, [params(i, RequestOutputKind.FINAL_ONLY) for i in range(num)],
                             use_tqdm=False)
    streamed = {}
    while smollm2.has_unfinished_requests():
        for output in smollm2.step():
            streamed.setdefault(output.request_id, []).append(output)
    num_tails_cut_before_a_whole_character = 0
    for i, out in enumerate(final):
        token_ids = out.outputs[0].token_ids
        assert streamed[f"cumulative {i}"][-1].outputs[0].token_ids == token_ids  # the same seed, the same tokens
        token_bytes = b"".join(SMOLLM2_TOKEN_BYTES[t] for t in token_ids)
        assert smollm2.tokenizer.decode(token_ids) == token_bytes.decode("utf-8", errors="replace")  # SmolLM2's bytes
        want = vllm_final_text(token_ids)
        assert out.outputs[0].text == want, token_ids
        assert streamed[f"cumulative {i}"][-1].outputs[0].text == want, token_ids
        assert "".join(delta.outputs[0].text for delta in streamed[f"delta {i}"]) == want, token_ids
        num_tails_cut_before_a_whole_character += want != token_bytes.decode("utf-8", errors="replace").rstrip("\ufffd")
    assert num_tails_cut_before_a_whole_character >= 3  # where a plain decode, unfinished tail dropped, differs
