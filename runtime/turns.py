"""Where the next turn of a conversation starts: the tokens a finished request's conversation
begins with when the client sends it back with the answer, which `RequestFlow.keep_turn` keeps
in the prefix cache (docs/prefix-cache.md, answers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from layersplit.runtime.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from layersplit.runtime.openai_api import ParsedRequest
    from layersplit.runtime.tokenizer import TextTokenizer


def assistant_message(text: str, parses_tool_calls: bool) -> dict[str, Any]:
    """The chat answer as the server returns it (and the client sends it back next turn): its
    tool calls parsed out of the text where the request offered tools."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parses_tool_calls:
        message["content"], calls = parse_tool_calls(text)
        if calls:
            message["tool_calls"] = calls
    return message


def next_turn_tokens(tokenizer: TextTokenizer | None, req: ParsedRequest,
                     prompt_ids: Sequence[int], generated: Sequence[int],
                     text: str) -> list[int]:
    """The tokens the conversation's next request starts with: for a chat, the messages and
    the answer rendered by the chat template as they will be next turn (the answer's end of
    turn included, the re-tokenized text where it differs from the sampled tokens); for a
    completion, the prompt and the tokens generated."""
    if req.kind != "chat" or tokenizer is None or req.messages is None:
        return [*prompt_ids, *generated]
    messages = [*req.messages, assistant_message(text, req.parses_tool_calls)]
    return tokenizer.encode_chat(messages, tools=req.tools, add_generation_prompt=False)
