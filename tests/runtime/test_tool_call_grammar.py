"""The grammar of forced tool calls (`runtime.grammar.tool_call_grammar`): a tool's parameters
sit under "arguments" in it, and their references still resolve as they do in the parameters
alone: "#/$defs/..." from the parameters' root, a plain-name "#anchor" anywhere, and within a
schema of its own `$id`, from that schema."""

from __future__ import annotations

import json

import pytest

PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PARAMETERS = {
    "defs": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                              "default": {"$ref": "#/$defs/P"}},
             "$defs": {"P": PLACE}},
    "definitions, escaped": {"type": "object", "properties": {"p": {"$ref": "#/definitions/a~1b"}},
                             "definitions": {"a/b": PLACE}},
    "root": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"},
                                                       "maxItems": 1}}},
    "anchor": {"type": "object", "properties": {"p": {"$ref": "#place"}},
               "$defs": {"P": {**PLACE, "$anchor": "place"}}},
    "$id": {"$id": "https://example.com/book", "type": "object",
            "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": PLACE}},
    "data": {"type": "object", "properties": {"p": {"const": {"$ref": "#/x"}}}},
}


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_references_in_tool_parameters_resolve_as_in_the_parameters_alone(name):
    import llguidance
    from layersplit.runtime.grammar import _rebased, tool_call_grammar

    params = PARAMETERS[name]
    alone = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(params))
    assert llguidance.LLMatcher.validate_grammar(alone, None) == ""
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    lark = tool_call_grammar(tools, ["f"], parallel=False)
    err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark),
                                                None)
    assert err == "", err
    if name == "data":  # (a "$ref" inside a value is data: kept as it is)
        assert _rebased(params, "/b") == params
