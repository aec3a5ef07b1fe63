"""Hermes-style tool calls parsed from text, whole and streamed piece by piece."""

from __future__ import annotations

import json

import pytest
from layersplit.runtime.tool_calls import ToolCallStream, parse_tool_calls, tool_format

TEXT = ('let me look <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\ndone')


def test_whole_text():
    content, calls = parse_tool_calls(TEXT)
    assert content == "let me look done"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}), ("g", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_tool_calls("plain text") == ("plain text", [])
    # a block whose JSON is not a call stays text; an unclosed block too
    bad = "a <tool_call>{oops}</tool_call> b <tool_call>{\"name\": \"f\""
    assert parse_tool_calls(bad) == (bad, [])


def test_streamed_piece_by_piece_equals_whole():
    for size in (1, 3, 7, 1000):
        s, events = ToolCallStream(), []
        for i in range(0, len(TEXT), size):
            events += s.push(TEXT[i:i + size])
        events += s.finish()
        text = "".join(v for k, v in events if k == "text")
        names = [v["function"]["name"] for k, v in events if k == "call"]
        assert (text, names) == ("let me look done", ["f", "g"])
        # no text that could start a block went out before it was known not to
        assert all("<" not in v for k, v in events if k == "text")


def test_template_detection():
    assert tool_format("{% if tools %}...<tool_call>...{% endif %}") == "hermes"
    assert tool_format("{{ message['content'] }}") is None
    assert tool_format(None) is None


def test_hermes_messages_write_tools_calls_and_results_as_text():
    from layersplit.runtime.tool_calls import DEFAULT_SYSTEM, hermes_messages

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "b", "type": "function",
                 "function": {"name": "f", "arguments": {"y": "é"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "user", "content": "thanks"}]
    out = hermes_messages(msgs, [tool])
    assert out[0]["role"] == "system"
    assert out[0]["content"].startswith(DEFAULT_SYSTEM + "\n\n# Tools")
    assert '\n{"type": "function", "function": {"name": "f"' in out[0]["content"]
    assert out[1] == msgs[0]  # (left as it was)
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "f", "arguments": {"y": "é"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n1\n</tool_response>\n"
                                                 "<tool_response>\n2\n</tool_response>"}
    assert out[4] == msgs[4] and len(out) == 5
    assert msgs[2]["role"] == "tool"  # (the request's messages are not changed)


def test_a_string_argument_may_hold_the_closing_tag():
    """The grammar lets a string argument hold `</tool_call>`: the block ends after the JSON
    value, whole or streamed a character at a time."""
    text = ('<tool_call>\n{"name": "search", "arguments": {"query": "a</tool_call> b", '
            '"n": 6}}\n</tool_call>\nafter')
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["search"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "a</tool_call> b", "n": 6}
    assert content == "after"
    stream, got = ToolCallStream(), []
    for ch in text:
        got += stream.push(ch)
    got += stream.finish()
    assert [k for k, _ in got if k == "call"] == ["call"]
    assert "".join(v for k, v in got if k == "text") == "after"


def test_a_block_that_is_not_json_stays_text_and_the_next_one_parses():
    text = '<tool_call>oops</tool_call> then <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>oops</tool_call> then "
    assert [c["function"]["name"] for c in calls] == ["f"]


@pytest.mark.parametrize("tail", ['-3', '1.5', 'true', '"\\u00e9"'])
def test_a_streamed_close_in_a_string_before_a_cut_token(tail):
    """A value after the string may arrive a character at a time (`-`, `1.`, `t`, `\\u`): the
    close inside the string still does not end the block."""
    text = '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>b", "n": ' + tail + \
        '}}\n</tool_call>'
    stream, got = ToolCallStream(), []
    for ch in text:
        got += stream.push(ch)
    got += stream.finish()
    calls = [v for k, v in got if k == "call"]
    assert len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"])["s"] == "a</tool_call>b"


def test_a_long_streamed_argument_is_decoded_once_per_close(monkeypatch):
    """The block's JSON is decoded again only when a close has come: a long argument streamed
    a few characters at a time is decoded once, not once per piece."""
    from layersplit.runtime import tool_calls

    calls = []
    real = tool_calls._block_end
    monkeypatch.setattr(tool_calls, "_block_end", lambda buf: calls.append(1) or real(buf))
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [' + ", ".join(
        '{"k": %d}' % i for i in range(2000)) + ']}}\n</tool_call>'
    stream, got = ToolCallStream(), []
    for i in range(0, len(text), 3):
        got += stream.push(text[i:i + 3])
    assert [k for k, _ in got] == ["call"] and len(calls) == 1


def test_a_template_without_a_system_role_takes_the_tools_in_the_first_user_message(
        tiny_llama):
    from layersplit.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer.from_path(tiny_llama)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    text = tok.render_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "hi"}], tools=[tool])
    assert text.startswith("<|im_start|>user\nBe brief.\n\n# Tools")
    assert text.endswith("</tool_call>\n\nhi<|im_end|>\n<|im_start|>assistant\n")
