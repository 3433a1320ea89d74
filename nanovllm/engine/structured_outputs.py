"""Structured outputs (vLLM's StructuredOutputManager), with xgrammar: a constraint compiled to a grammar
when its request is added (once per distinct constraint: the compiler keeps a cache), a matcher per
constrained completion that follows the completion's tokens, and the token masks of a step's constrained rows.

A step with constrained rows runs its model first; the engine then processes the step before (whose tokens
the matchers take), asks here for the masks, filled on xgrammar's threads while the device still runs the
model, and the runner samples with them. A step without constrained rows never comes here.
"""
import json
import logging

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import GrammarMasks
from nanovllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
class StructuredOutputs:
    """The grammars of the constrained completions, by sequence id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, config: dict):
        self.config = config  # Config.structured_outputs_config, checked and complete
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiler = self._batch = None  # made with the first constraint: xgrammar loads only then
        self.completions: dict[int, ConstrainedCompletion] = {}

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
            self._batch = xgrammar.BatchGrammarMatcher()
        return self._compiler

    def compile(self, params: StructuredOutputsParams, owner: str = "the prompt"):
        """The constraint's compiled grammar; ValueError naming the constraint if it cannot be compiled."""
        compiler = self.compiler  # made outside the try: its failure is not this constraint's
        try:
            return self._compile(compiler, params)
        except Exception as error:  # xgrammar raises RuntimeError or ValueError on a bad spec
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"{owner}'s structured outputs {params.kind} cannot be compiled: {message}") from None

    def _compile(self, compiler, params: StructuredOutputsParams):
        compact = params.disable_any_whitespace or self.config["disable_any_whitespace"]
        json_options = dict(any_whitespace=False, separators=(",", ":")) if compact else dict(any_whitespace=True)
        if params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, **json_options)
        if params.json_object:  # an object, not any JSON value (vLLM's)
            return compiler.compile_json_schema('{"type": "object"}', **json_options)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar(choice_grammar(params.choice))
        if params.grammar is not None:
            return compiler.compile_grammar(params.grammar)
        return self._compile_structural_tag(params.structural_tag)

    def _compile_structural_tag(self, text: str):
        import xgrammar
        tag = json.loads(text)
        if "structures" in tag:  # vLLM's older form: structures and their triggers
            items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(text)

    def add(self, seqs: list[Sequence], grammar):
        import xgrammar
        for seq in seqs:
            self.completions[seq.seq_id] = ConstrainedCompletion(xgrammar.GrammarMatcher(grammar))

    def forget(self, seqs: list[Sequence]):
        for seq in seqs:
            self.completions.pop(seq.seq_id, None)

    def masks(self, seqs: list[Sequence]) -> GrammarMasks | None:
        """The token masks of the rows (sequences in row order) whose completions are constrained, each
        grammar first advanced through its completion's tokens; None if no row is."""
        rows, matchers = [], []
        for row, seq in enumerate(seqs):
            completion = self.completions.get(seq.seq_id)
            if completion is None or seq.is_finished:
                continue
            completion.catch_up(seq)
            if completion.masks_next_token:
                rows.append(row)
                matchers.append(completion.matcher)
        if not rows:
            return None
        bitmask = np.empty((len(rows), -(-self.vocab_size // 32)), dtype=np.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return GrammarMasks(np.array(rows, dtype=np.int64), bitmask)


class ConstrainedCompletion:
    """A completion's grammar matcher and how many of its tokens the matcher has taken. A token the grammar
    refuses, which only a fault could have sampled, ends the constraint for that completion (with a warning)
    rather than the engine."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_taken = 0
        self.broken = False

    def catch_up(self, seq: Sequence):
        """Take the completion's tokens not yet taken."""
        for token_id in seq.token_ids[seq.num_prompt_tokens + self.num_taken:]:
            if not self.broken and not self.matcher.accept_token(token_id):
                self.broken = True
                logger.warning("token %d of sequence %d breaks its structured-outputs constraint: the rest of the "
                               "completion is not constrained", token_id, seq.seq_id)
        self.num_taken = len(seq.token_ids) - seq.num_prompt_tokens

    @property
    def masks_next_token(self) -> bool:
        return not self.broken and not self.matcher.is_terminated()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose output is one of the strings (vLLM's choice_as_grammar)."""
    def quoted(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return '"' + escaped.replace("\t", "\\t") + '"'
    return "root ::= " + " | ".join(quoted(choice) for choice in choices)
