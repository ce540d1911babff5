"""Constrained decoding on the host: llguidance compiles a request's constraint (a JSON schema, a regex, a choice, a
Lark/EBNF grammar) against the tokenizer, keeps one matcher per sequence, and fills each step's packed token
bitmask (i32[S, ceil(V/32)], bit v of row s set where token v is allowed) for the sampler to apply.

Rows without a constraint get every bit set, so they pass through the sampler unchanged. The mask covers the model's
vocabulary, which may be wider than the tokenizer's: the padding ids get no bit in a constrained row. A matcher sees
each token as the sequence takes it (OutputProcessor), so its state follows the sequence's output, and a preempted
sequence, which keeps its output, keeps its matcher.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jserve.sampling_params import InvalidParameterError, StructuredOutputsParams
from jserve.tokenizer import Tokenizer

_COMPILED_CACHE_SIZE = 256  # grammars kept compiled, by their text: repeated schemas compile once


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    import llguidance

    if spec.json_object or spec.json is not None:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # JSON in its compact layout: free whitespace lets a model pad with newlines until max_tokens.
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; thread-safe (the server checks a request's
    constraint before queueing it, the engine thread compiles it again from the cache)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Seq[int]):
        try:
            import llguidance.hf
        except ImportError as e:  # an optional dependency: only constrained requests need it
            raise InvalidParameterError("structured_outputs", "structured outputs need the llguidance package "
                                        "(pip install llguidance)") from e
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                                       eos_token=list(eos_token_ids) or None)
        self._lock = threading.Lock()
        self._compile = functools.lru_cache(_COMPILED_CACHE_SIZE)(self._compile_text)

    def _compile_text(self, text: str) -> str:
        """The grammar text, once llguidance has compiled it without error (raises InvalidParameterError)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, text)
        if matcher.is_error():
            raise InvalidParameterError("structured_outputs", f"the constraint does not compile: "
                                        f"{matcher.get_error()}"[:2000])
        return text

    def check(self, spec: StructuredOutputsParams) -> str:
        """Compile (or find compiled) the constraint -> its grammar text; InvalidParameterError if it fails."""
        try:
            text = grammar_text(spec)
        except ValueError as e:  # llguidance rejects the constraint's text itself (e.g. a schema that is not JSON)
            raise InvalidParameterError("structured_outputs", f"the constraint does not compile: {e}"[:2000]) from None
        with self._lock:
            return self._compile(text)

    def matcher(self, spec: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh matcher for one sequence of a request with this constraint."""
        from llguidance import LLMatcher

        return SequenceGrammar(LLMatcher(self._tokenizer, self.check(spec)))


class SequenceGrammar:
    """One sequence's matcher: what it may generate next, given what it has generated."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        """Feed a token the sequence took; False if the constraint did not allow it (the matcher then stays in
        error and allows nothing more but EOS)."""
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The constraint is complete: only an end of sequence may follow."""
        return bool(self._matcher.is_stopped())


def fill_bitmask(grammars: Seq[SequenceGrammar | None], pad_to: int, width: int) -> np.ndarray:
    """The step's i32[pad_to, width] bitmask: each constrained row from its matcher, every other row all ones.
    Several rows are filled by llguidance's thread pool (it releases the GIL); one row on this thread."""
    bitmask = np.full((pad_to, width), -1, np.int32)
    rows = [(grammar, row) for row, grammar in enumerate(grammars) if grammar is not None]
    if len(rows) == 1:
        rows[0][0].fill(bitmask, rows[0][1])
    elif rows:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(g._matcher, row) for g, row in rows], bitmask)
    return bitmask


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor()
