"""The first shard's side of proposals the draft hands it directly.

With the verdict of a verify step, the draft prepares the sequence's next proposal
(`draft.prepared`). Where the first shard feeds the draft, the draft sends that proposal to it
(`drafted`) instead of waiting for the coordinator to ask: the coordinator sends the next step at
once as a decode segment that `ask`s for the proposal, and the first shard holds that step until
the proposal comes, then makes the segment a verify segment with its tokens. The coordinator is
then off the path between the draft and the shards: a round is the shards' verify step plus the
draft's step, not two more trips through the coordinator.

Nothing here trusts the proposal: a missing one (the draft is gone, it could not prepare it, it
was late), one prepared for another key, or a malformed one leaves the segment a decode step
of its one row, which is exact all the same; the outcome says why (`asked.missed`).
"""

from __future__ import annotations

from typing import Any

import torch
from layersplit.ipc.messages import ProtocolError
from layersplit.shards.spec_tree import check_proposal, check_q

DRAFT_WAIT_S = 5.0  # a held step waits this long for its proposal, then runs without it


def asked(msg: dict[str, Any]) -> bool:
    """Whether a step has a segment asking for the draft's proposal; its asks checked first
    (ProtocolError naming what is wrong: such a step is refused, never held)."""
    found = False
    for i, seg in enumerate(msg["seqs"]):
        if seg["ask"] is not None:
            _check_ask(seg, f"step: segment {i}")
            found = True
    return found


def check_drafted(msg: dict[str, Any]) -> None:
    """A `drafted` message's key and outcome (its field types are checked on receipt, its
    tokens against the step that asked for them, `fill`); ProtocolError naming what is
    wrong."""
    key = msg["key"]
    if len(key) != 5 or not all(isinstance(v, int) and not isinstance(v, bool)
                                for v in key[:4]) or not (
            key[4] is None or isinstance(key[4], list)):
        raise ProtocolError(f"drafted: key {key!r} is not [pos, token, n, tree, kept]"[:200])
    if msg["tokens"] is None and msg["error"] is None:
        raise ProtocolError("drafted: neither tokens nor an error")


def _proposal(seg: dict[str, Any], token: int, got: dict[str, Any] | None, why_missing: str,
              vocab: int) -> tuple[list[int], list[int] | None, list | None] | str:
    """The draft tokens (their tree, and a sampled proposal's q) for an asked segment whose
    last token is `token`, or why there are none."""
    ask = seg["ask"]
    if got is None or got["after"] < ask["after"]:
        return why_missing
    if got["tokens"] is None:
        return f"the draft could not prepare it: {got['error']}"
    want = [seg["pos"], token, ask["n"], ask["tree"], seg["kept"]]
    if got["key"] != want:
        return f"the draft prepared {got['key']} for step {got['after']}, not {want}"[:300]
    tokens, parents = got["tokens"], got["parents"]
    try:
        if not tokens:
            raise ValueError("no tokens")
        check_proposal(tokens, parents, ask["n"], ask["tree"], vocab)
        if got["q"] is not None:
            check_q(got["q"], tokens, parents, vocab)
    except ValueError as e:
        return f"the draft proposed {e}"
    return list(tokens), None if parents is None else list(parents), got["q"]


def _check_ask(seg: dict[str, Any], where: str) -> None:
    ask = seg["ask"]
    if not isinstance(ask, dict):
        raise ProtocolError(f"{where}: ask must be a map")
    if not all(isinstance(ask.get(k), int) and not isinstance(ask.get(k), bool) and ask[k] >= 0
               for k in ("n", "tree", "after")):
        raise ProtocolError(f"{where}: ask={ask!r} needs n, tree and after, integers >= 0"[:300])
    if not isinstance(seg["feat"], int):
        raise ProtocolError(f"{where}: a segment that asks for draft tokens needs the "
                            "sequence's draft context (feat)")
    if seg["n"] != 1 or seg["draft"] is not None or seg["tree"] is not None:
        raise ProtocolError(f"{where}: a segment that asks for draft tokens must be one row "
                            "with none of its own")
    if seg["sample"] is None:
        raise ProtocolError(f"{where}: a segment that asks for draft tokens needs its sampling "
                            "parameters")


def ready(msg: dict[str, Any], drafted: dict[int, dict[str, Any]]) -> bool:
    """Whether every asked segment's proposal (or the draft's word that there is none) came."""
    for seg in msg["seqs"]:
        ask = seg["ask"]
        if ask is not None:
            got = drafted.get(seg["feat"])
            if got is None or got["after"] < ask["after"]:
                return False
    return True


def fill(msg: dict[str, Any], x: torch.Tensor, drafted: dict[int, dict[str, Any]],
         why_missing: str, waited: float, vocab: int) -> torch.Tensor:
    """Make each asked segment of the step `msg` (in place) a verify segment with its proposal
    from `drafted` (context -> the last `drafted` message), or a decode segment that says why
    not (`why_missing`: why for those whose proposal did not come; a proposal of other than
    token ids of `vocab`, too long or too deep is none); returns the step's token ids with the
    draft tokens in place. Its asks were checked (`asked`)."""
    ids = x.tolist()
    out: list[int] = []
    a = 0
    for seg in msg["seqs"]:
        n = seg["n"]
        rows, a = ids[a:a + n], a + n
        ask = seg["ask"]
        if ask is None:
            out.extend(rows)
            continue
        got = drafted.get(seg["feat"])
        found = _proposal(seg, rows[0], got, why_missing, vocab)
        compute = float(got["compute_s"]) if got is not None else 0.0
        if isinstance(found, str):
            seg["then"] = None  # a decode segment: no verdict, nothing to prepare
            seg["asked"] = {"draft": None, "tree": None, "missed": found, "waited": waited,
                            "compute": 0.0}
            out.extend(rows)
        else:
            tokens, parents, q = found
            seg.update(n=1 + len(tokens), draft=tokens, tree=parents, q=q)
            seg["asked"] = {"draft": tokens, "tree": parents, "missed": None, "waited": waited,
                            "compute": compute}
            out.extend([rows[0], *tokens])
        seg["ask"] = None
    return torch.tensor(out, dtype=torch.int64)
