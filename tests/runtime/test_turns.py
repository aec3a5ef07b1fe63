"""The tokens a kept turn is stored under (`runtime.turns.next_turn_tokens`) are those the next
turn's request renders: the answer as the server returns it, sent back by the client and
parsed as any request's messages."""

from __future__ import annotations

import json
from pathlib import Path

from layersplit.runtime.openai_api import parse
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.runtime.turns import assistant_message, next_turn_tokens

TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "templates" / "chatml-tools.jinja"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ANSWER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_call_answer_is_kept_as_the_next_turn_renders_it(tiny_llama):
    tok = TextTokenizer.from_path(tiny_llama)
    tok.chat_template = TEMPLATE.read_text()
    first = [{"role": "user", "content": "weather in Paris?"}]
    req = parse({"messages": first, "tools": [WEATHER]}, "chat", "m")
    prompt = tok.encode_chat(req.messages, tools=req.tools)
    generated = tok.encode(ANSWER, add_special_tokens=False)
    kept = next_turn_tokens(tok, req, prompt, generated, ANSWER)
    # the client sends the answer back as the server returned it (arguments as a JSON string)
    returned = json.loads(json.dumps(assistant_message(ANSWER, True)))
    assert isinstance(returned["tool_calls"][0]["function"]["arguments"], str)
    nxt = parse({"messages": [*first, returned,
                              {"role": "tool", "content": "sunny", "tool_call_id": "x"}],
                 "tools": [WEATHER]}, "chat", "m")
    following = tok.encode_chat(nxt.messages, tools=nxt.tools)
    assert following[:len(kept)] == kept
