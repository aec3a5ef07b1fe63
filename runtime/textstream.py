"""Incremental detokenization with stop strings, for streaming.

Byte-level BPE tokens may end in the middle of a UTF-8 character, and a stop string may span
several tokens, so text is released only once it can no longer change or match a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from layersplit.runtime.tokenizer import TextTokenizer


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (stable part)
        self.emitted = 0  # characters of self.text already released
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to release (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tok.decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is held back (end of generation)."""
        if not self.stopped:
            tail = self.tok.decode(self.ids[self._prefix_offset:])
            prefix = self.tok.decode(self.ids[self._prefix_offset:self._read_offset])
            if len(tail) > len(prefix):
                self.text += tail[len(prefix):]
                self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            end -= _held_suffix(self.text, self.stop)
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
