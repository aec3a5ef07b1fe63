"""Token ids of rendered conversations, from the ids of the text they start with.

A chat's next request renders the whole conversation again, and tokenizing it all again costs
time in proportion to the conversation (45 ms for 18K tokens on a loaded 2-core VM), twice a
turn: the request, and the answer kept for the next turn (`runtime.turns`). But a tokenizer
splits its text at added tokens before anything else and tokenizes the pieces between them
apart, so the ids of a text that starts with P, where P ends with such a token, are P's ids and
then those of the rest, tokenized alone. `PrefixIds` remembers, for the last texts it encoded,
their longest prefix ending with a safe added token and its ids; a text that starts with one
is encoded from there: the new message's tokens, not the conversation's.

An added token is a safe boundary where nothing around it changes how it or the text after it
is read: it strips no whitespace (`lstrip`, `rstrip`), matches anywhere (`single_word` off), is
matched in the raw text (`normalized` off), and no other added token starts with its text (the
longest match at its place would not depend on what follows). The pre-tokenizer must treat
every piece alike: a Metaspace that prepends its space only to the first piece
(`prepend_scheme` first) does not, and turns this off, as does any pre-tokenizer not known to
(`SAFE_PRE_TOKENIZERS`).
"""

from __future__ import annotations

import json
import threading
from array import array
from typing import Any

from tokenizers import Tokenizer

SAFE_PRE_TOKENIZERS = frozenset(("ByteLevel", "Digits", "Split", "Sequence", "Punctuation",
                                 "Whitespace", "WhitespaceSplit", "BertPreTokenizer",
                                 "UnicodeScripts"))
KEEP = 16  # prefixes remembered (least recently used dropped first)


def boundary_ids(tk: Tokenizer) -> frozenset[int]:
    """The added tokens of `tk` after which its text is tokenized apart (the module's doc);
    empty where its pre-tokenizer does not tokenize each piece alike."""
    pre = tk.pre_tokenizer  # (its JSON alone: the whole tokenizer's takes 0.1 s)
    if not _pieces_alike(None if pre is None else json.loads(pre.__getstate__())):
        return frozenset()
    added = tk.get_added_tokens_decoder()
    texts = [a.content for a in added.values()]
    safe = set()
    for i, a in added.items():
        c = a.content
        if a.lstrip or a.rstrip or a.single_word or a.normalized:
            continue
        if not c or any(t != c and c in t for t in texts):  # (a longer one holding it may
            # begin before it: "a<e>b" takes the "a" before "<e>" that an encode after
            # "<e>" never sees)
            continue
        safe.add(int(i))
    return frozenset(safe)


def _pieces_alike(pre: Any) -> bool:
    if pre is None:
        return True
    if not isinstance(pre, dict) or pre.get("type") not in SAFE_PRE_TOKENIZERS:
        return False
    return all(_pieces_alike(p) for p in pre.get("pretokenizers") or [])


class PrefixIds:
    """`encode(text)`: the ids `tk.encode(text, add_special_tokens=False)` gives, from the
    longest remembered prefix of `text` (thread-safe)."""

    def __init__(self, tk: Tokenizer, keep: int = KEEP) -> None:
        self.tk, self.keep = tk, keep
        self.safe = boundary_ids(tk)
        self._known: list[tuple[str, array]] = []  # (prefix text, its ids), most recent first
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        base, ids = self._longest(text)
        enc = self.tk.encode(text[len(base):], add_special_tokens=False)
        tail = enc.ids
        if self.safe:
            self._remember(text, base, ids, tail, enc.offsets)
        return ids.tolist() + tail if len(ids) else tail

    def _longest(self, text: str) -> tuple[str, array]:
        with self._lock:
            best = max((k for k in self._known if text.startswith(k[0])),
                       key=lambda k: len(k[0]), default=None)
            if best is None:
                return "", array("i")
            self._known.remove(best)
            self._known.insert(0, best)
            return best

    def _remember(self, text: str, base: str, ids: array, tail: list[int],
                  offsets: list[tuple[int, int]]) -> None:
        """The longest prefix of `text` that ends with a safe added token of `tail`."""
        for k in range(len(tail) - 1, -1, -1):
            if tail[k] in self.safe:
                break
        else:
            return
        lo, hi = offsets[k]
        if text[len(base) + lo:len(base) + hi] != self.tk.id_to_token(tail[k]):
            return  # (offsets that do not point at the token's text: nothing is remembered)
        prefix = text[:len(base) + hi]
        new = array("i", ids)
        new.extend(tail[:k + 1])
        with self._lock:
            self._known = [(prefix, new), *(e for e in self._known if e[0] != prefix)]
            del self._known[self.keep:]
