"""Tool calls in a model's output: the format its chat template teaches, parsed into OpenAI's
`tool_calls` (whole, and as a stream).

One format is supported: Hermes-style, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, one block per call, which the templates of Qwen2.5 / Qwen3, Hermes and the
SmolLM-style ChatML-with-tools models teach. A template is taken to use it when it writes
`<tool_call>`. A template that writes no tool calls gets the same format through the messages
themselves (`hermes_messages`): the tools in the system message, calls and results as text, as
Qwen2.5's template writes them, so any chat model can be asked for tool calls (and a `required`
or named `tool_choice` holds by grammar whatever the model knows).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches: "hermes", or None (none this server
    parses)."""
    if chat_template and OPEN in chat_template and "tools" in chat_template:
        return "hermes"
    return None


TOOLS_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}"
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
DEFAULT_SYSTEM = "You are a helpful assistant."


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                    system: bool = True) -> list[dict[str, Any]]:
    """`messages` with `tools` and every tool call and result written as text in the Hermes
    format, for a chat template that writes none: the tools after the system message (or a
    default one), an assistant's calls as `<tool_call>` blocks after its text, consecutive tool
    results as one user message of `<tool_response>` blocks. A ChatML model renders these
    exactly as Qwen2.5's template (`configs/templates/chatml-tools.jinja`) renders the
    originals. `system=False` (a template that takes no system role, as Gemma's): the system
    text and the tools go at the head of the first user message instead."""
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    out: list[dict[str, Any]] = []
    rest = list(messages)
    system_text = None
    if rest and rest[0].get("role") == "system":
        system_text = _text(rest.pop(0).get("content"))
    head = (system_text or DEFAULT_SYSTEM) + TOOLS_PROMPT.format(tools=listed)
    if system:
        out.append({"role": "system", "content": head})
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [_text(m.get("content"))] if m.get("content") else []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass  # (written as given)
                parts.append('<tool_call>\n{"name": ' + json.dumps(fn.get("name"),
                                                                    ensure_ascii=False)
                             + ', "arguments": ' + json.dumps(args, ensure_ascii=False)
                             + "}\n</tool_call>")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = "<tool_response>\n" + _text(m.get("content")) + "\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    if not system:
        first = next((m for m in out if m.get("role") == "user"), None)
        if first is None:
            out.insert(0, {"role": "user", "content": head})
        else:
            first["content"] = head + "\n\n" + _text(first.get("content"))
    return out


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside one block; None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(
                             args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the tool-call blocks, None if only blanks; the calls). A block whose
    JSON is not a call stays in the text, as the model wrote it."""
    stream = ToolCallStream()
    content, calls = [], []
    for kind, value in [*stream.push(text), *stream.finish()]:
        (calls if kind == "call" else content).append(value)
    joined = "".join(content)
    return (joined if joined.strip() else None), calls


class ToolCallStream:
    """Text pushed piece by piece comes out as ("text", str) and ("call", dict) events: text
    that may start a block is held back until it is known not to."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.after_call = False  # newlines right after a call's block are its, not text
        self.seen = 0  # inside a block: the text before this holds no close not tried yet

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.after_call and not self.inside:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.after_call = False
            if self.inside:
                # (the block's JSON is decoded again only when a close has come since: a long
                # argument streamed a token at a time costs one pass, not one per token)
                end = None
                if self.buf.find(CLOSE, self.seen) >= 0:
                    end = _block_end(self.buf)
                if end is None:
                    self.seen = max(0, len(self.buf) - len(CLOSE) + 1)
                    return out
                self.seen = 0
                body = self.buf[:end]
                self.buf = self.buf[end + len(CLOSE):]
                self.inside = False
                call = _call(body.strip())
                out.append(("call", call) if call is not None else
                           ("text", OPEN + body + CLOSE))
                self.after_call = call is not None
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(("text", self.buf[:start]))
                self.buf = self.buf[start + len(OPEN):]
                self.inside = True
                continue
            keep = _partial_open(self.buf)
            if len(self.buf) > keep:
                out.append(("text", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the output: a block never closed is text."""
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [("text", rest)] if rest else []


def _block_end(buf: str) -> int | None:
    """Where the `</tool_call>` that closes a block starts (`buf`: the text after its
    `<tool_call>`), None while it may still come. A block holding a JSON value ends at the first
    close after that value, so a string argument may itself hold `</tool_call>`; a block
    whose text is not JSON ends at the first close after the point where it stops being JSON
    (and stays text)."""
    lead = len(buf) - len(buf.lstrip())
    try:
        _, k = _DECODER.raw_decode(buf, lead)
    except ValueError as e:
        pos = getattr(e, "pos", len(buf))
        if pos >= len(buf) or str(e).startswith("Unterminated string"):
            return None  # (the value goes on: wait for it)
        k = pos  # (not JSON from here, or a token cut short: the close comes after it)
    end = buf.find(CLOSE, k)
    return end if end >= 0 else None


_DECODER = json.JSONDecoder()


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
