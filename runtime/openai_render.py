"""OpenAI response pieces: choices, logprobs (chat's and completions' shapes) and usage.

Logprob entries come from the last shard (`shards.sampling.logprob_entries`): [token, logprob,
[top ids], [top logprobs]]. A logprob of -inf (a token a grammar or `logit_bias` ruled out) is
written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from layersplit.runtime.tokenizer import TextTokenizer

NEG_INF_LOGPROB = -9999.0


def _lp(v: float) -> float:
    return v if v > NEG_INF_LOGPROB else NEG_INF_LOGPROB


class Renderer:
    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self.tok = tokenizer

    def text(self, token: int) -> str:
        if self.tok is None:
            return f"token_id:{token}"
        return self.tok.decode([token], skip_special_tokens=False)

    def chat_logprobs(self, entries: Sequence[list]) -> dict[str, Any]:
        def one(t: int, v: float) -> dict[str, Any]:
            s = self.text(t)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode())}

        return {"content": [{**one(t, v), "top_logprobs": [one(i, w) for i, w in zip(ti, tv)]}
                            for t, v, ti, tv in entries]}

    def completion_logprobs(self, entries: Sequence[list | None], offset: int = 0
                            ) -> dict[str, Any]:
        """Completions' shape; an entry None is the prompt's first token (no logprob): its
        token is then given as `[token]`, a one-item list."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for e in entries:
            if isinstance(e, int):  # the prompt's first token
                s = self.text(e)
                out["tokens"].append(s)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                t, v, ti, tv = e
                s = self.text(t)
                top = {self.text(i): _lp(w) for i, w in zip(ti, tv)}
                top[s] = _lp(v)  # the chosen token is always listed (vLLM's shape)
                out["tokens"].append(s)
                out["token_logprobs"].append(_lp(v))
                out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
