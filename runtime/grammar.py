"""Structured output: grammars that constrain a sequence's tokens, with llguidance.

A request's `response_format` (json_object, json_schema) or a `tool_choice` that demands a call
(`required`, a named function) becomes a grammar: a JSON schema, or a Lark grammar that wraps
the calls' JSON in the template's tool-call blocks (`runtime.tool_calls`). It is compiled once
per request when it arrives (a schema llguidance cannot compile is refused, 400, naming the
field); each sequence then gets a matcher that the coordinator advances with its tokens and asks
for the mask of the next token's allowed tokens, which the last shard applies before it samples
(`shards.sampling`). A mask follows the token its step carries, so the coordinator computes it
while that step runs and sends it after the step (`runtime.decoding.LATE_MASK`); the last shard
holds the step's sampling until it has it. Constrained requests are not speculated
(`runtime.decoding`).
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
from layersplit.runtime.tokenizer import TextTokenizer


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled; the message says why."""


class GrammarCompiler:
    """llguidance's view of one model's tokenizer (built once: about a second on large
    vocabularies)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab = vocab_size
        self.eos = list(eos_ids)
        self.ll = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=vocab_size,
                                         eos_token=self.eos or None)
        self._lock = threading.Lock()

    def json_schema(self, schema: Any) -> str:
        """The grammar of JSON text valid against `schema`; GrammarError if it cannot be."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return self._checked(grammar)

    def lark(self, text: str) -> str:
        return self._checked(llguidance.LLMatcher.grammar_from_lark(text))

    def _checked(self, grammar: str) -> str:
        ok, err = True, ""
        try:
            err = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        except (ValueError, TypeError) as e:
            err = str(e)
        ok = not err
        if not ok:
            raise GrammarError(err)
        return grammar

    def matcher(self, grammar: str) -> SequenceGrammar:
        return SequenceGrammar(llguidance.LLMatcher(self.ll, grammar), self.vocab)


class SequenceGrammar:
    """One sequence's matcher (`runtime.decoding.TokenGrammar`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self.m = matcher
        self.vocab = vocab
        self.seen = 0
        self.bitmask = llg_numpy.allocate_token_bitmask(1, vocab)

    def mask(self, generated: Sequence[int]) -> bytes | None:
        new = list(generated[self.seen:])
        self.seen = len(generated)
        if new and not self.m.consume_tokens(new):
            raise GrammarError(f"the grammar refused the sampled tokens {new}: "
                               f"{self.m.get_error()}")
        llg_numpy.fill_next_token_bitmask(self.m, self.bitmask, 0)
        if self.m.is_error():
            raise GrammarError(f"the grammar failed: {self.m.get_error()}")
        # int32 words, little-endian: bit j of word w is token 32 w + j (`shards.sampling`)
        return zlib.compress(self.bitmask[0].tobytes(), 1)


# keywords whose values are data, not schemas: a "$ref" inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names (which may be any word, "const" too) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local JSON-pointer reference ("#" or "#/...", resolved from its root)
    made to resolve from a document that holds it at the JSON pointer `base`: a tool's
    parameters nested under "arguments" keep their "#/$defs/..." references (as pydantic writes
    them). A plain-name fragment ("#name", a `$anchor`) resolves anywhere in the document and
    stays; so does a schema with its own `$id` (its references resolve from it already)."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + base + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _NAMED_SCHEMAS and isinstance(v, dict):
            out[k] = {name: _rebased(sub, base) for name, sub in v.items()}
        else:
            out[k] = _rebased(v, base)
    return out


def tool_call_grammar(tools: list[dict[str, Any]], names: Sequence[str],
                      parallel: bool) -> str:
    """Lark text of one or more Hermes tool-call blocks calling one of `names` with arguments
    valid against its parameters."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    alts = []
    for i, name in enumerate(names):
        params = _rebased(by_name[name].get("parameters") or {"type": "object"},
                          "/properties/arguments")
        schema = {"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}}
        alts.append((f"call_{i}", schema))
    rules = [f"call_{i}: %json {json.dumps(s)}" for i, (_, s) in enumerate(alts)]
    body = " | ".join(n for n, _ in alts)
    call = f'"<tool_call>\\n" ({body}) "\\n</tool_call>"'
    start = f"start: block (\"\\n\" block)*\nblock: {call}" if parallel else f"start: {call}"
    return "\n".join([start, *rules])
