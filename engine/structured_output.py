"""Structured outputs: a request's output held to JSON (any object, or a JSON Schema) by xgrammar's token mask.

`StructuredOutput` is what a request asks for. `Grammars` compiles each distinct one once against the model's
vocabulary and starts a matcher per request; the matcher advances with every token the request emits. Every step,
`GrammarMask` fills one bitmask for the rows that have a grammar and applies it to those rows' logits in one call,
on the logits' device; rows without a grammar are not touched.

xgrammar is imported on first use: an engine that never sees a grammar never loads it.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """`type` "json_object": any JSON object; "json_schema": a document valid against `schema` (JSON Schema as JSON
    text). Checked by `check`, not on construction, so that a bad value decoded from the wire fails its request
    only."""
    type: str
    schema: str | None = None

    def check(self) -> None:
        """ValueError naming the problem."""
        if self.type == JSON_OBJECT:
            if self.schema is not None:
                raise ValueError("a json_object format takes no schema")
            return
        if self.type != JSON_SCHEMA:
            raise ValueError(f"structured output type must be {JSON_OBJECT!r} or {JSON_SCHEMA!r}, got {self.type!r}")
        if not isinstance(self.schema, str):
            raise ValueError("a json_schema format needs its schema")
        try:
            schema = json.loads(self.schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")


# xgrammar's errors start with a log prefix, "[hh:mm:ss] /path/file.cc:123: "
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class Grammars:
    """Compiled grammars of the recent distinct structured outputs (an LRU of `capacity`), and matchers over them.

    Thread-safe: a front end compiles a request's grammar off the step loop before admission, so that the engine
    thread finds it compiled."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], capacity: int = 64):
        """`vocab_size`: the model's (the width of its logits), which may exceed the tokenizer's; the ids past the
        tokenizer's are never allowed. `stop_token_ids`: the tokens that end a request once its document is done."""
        self.hf_tokenizer, self.vocab_size, self.stop_token_ids = hf_tokenizer, vocab_size, sorted(stop_token_ids)
        self.capacity = capacity
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> "xgr.CompiledGrammar":
        """The grammar of `spec` (checked already), compiled on the first request for it; ValueError names a schema
        xgrammar refuses."""
        with self._lock:
            grammar = self._compiled.get(spec)
            if grammar is not None:
                self._compiled.move_to_end(spec)
                return grammar
            compiler = self._compiler_locked()
        try:
            if spec.type == JSON_OBJECT:  # xgrammar's built-in JSON grammar would take arrays too
                grammar = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            else:
                # Compact separators: free whitespace lets a weak model pad the document with newlines forever.
                grammar = compiler.compile_json_schema(spec.schema, strict_mode=True, any_whitespace=False)
        except RuntimeError as e:
            raise ValueError(f"the JSON schema is not supported: {_LOG_PREFIX.sub('', str(e)).strip()}") from None
        with self._lock:
            self._compiled[spec] = grammar
            self._compiled.move_to_end(spec)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput) -> "xgr.GrammarMatcher":
        """A matcher at the start of `spec`'s document: one per request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def _compiler_locked(self) -> "xgr.GrammarCompiler":
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


@dataclass(slots=True)
class GrammarMask:
    """The rows of one step's sampled batch that have a grammar, with their matchers."""
    rows: list[int]
    matchers: list["xgr.GrammarMatcher"]
    num_rows: int  # rows in the batch
    vocab_size: int

    @classmethod
    def of(cls, matchers: list["xgr.GrammarMatcher | None"], vocab_size: int) -> "GrammarMask | None":
        """None when no row has a grammar: such a batch is sampled as if grammars did not exist."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        return cls(rows, [matchers[i] for i in rows], len(matchers), vocab_size)

    def bitmask(self) -> torch.Tensor:
        """int32 [rows, ceil(vocab / 32)] on the CPU: bit t of row i set when token t may follow row i's output.
        Rows without a grammar are left all-allowed."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(self.num_rows, self.vocab_size)
        _batch_matcher().batch_fill_next_token_bitmask(self.matchers, bitmask, self.rows)
        return bitmask

    def nearest_allowed(self, tokens: list[int]) -> list[int]:
        """`tokens` with each grammar row's token moved to the first one its grammar allows at or after it (wrapping
        around the vocabulary): how an executor without logits keeps to the grammars."""
        bits = (self.bitmask()[self.rows, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten(1)[:, :self.vocab_size].bool()
        out = list(tokens)
        for row, ok in zip(self.rows, allowed):
            ids = ok.nonzero().flatten()
            later = ids[ids >= out[row]]
            out[row] = int(later[0] if len(later) else ids[0])
        return out

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of every token a row's grammar forbids to -inf, in place, on the logits' device."""
        import xgrammar as xgr

        bitmask = self.bitmask().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


@functools.cache
def _batch_matcher() -> "xgr.BatchGrammarMatcher":
    """Fills the bitmask rows of a batch on a few threads of xgrammar's own."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()
