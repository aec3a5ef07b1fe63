"""The bench oracle's proposer (`draft.oracle_table` says what the oracle is and where its table
comes from): a DFlash proposer that computes every proposal, then replaces its tokens.

Which table sequence a slot follows is keyed by every token its sequence committed since its
first proposal (the draft knows them: the tokens its proposals are asked after, and the draft
tokens of its own proposals that the verify steps kept), not only by the tokens at the positions
it was asked after: two table sequences (a plain run's output and a speculative pass's, which
left it at a near-tie) that agree there but not on a kept token in between are told apart. Of
the agreeing sequences the one added last goes (the latest pass's, whose verify steps ran as the
next pass's do). Where the sequence left every one of them, it is looked up again at each later
proposal by its last `REENTRY` tokens anywhere in the table (a prompt-lookup draft's rule): a
sequence that came back onto a known continuation (a loop, an earlier pass's branch) is
followed again instead of the draft's own tokens to its end."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from layersplit.draft.oracle_table import OracleTable, reread
from layersplit.draft.proposer import DFlashProposer

log = logging.getLogger(__name__)

REENTRY = 8  # the last tokens of a sequence that left the table that find it in the table again


class OracleProposer(DFlashProposer):
    """A `DFlashProposer` that computes every proposal and then replaces its tokens (from its
    table, `draft.oracle_table`). `oracle` must be set before the first proposal."""

    oracle: OracleTable
    # per slot: (table sequence, shift) pairs that agree with every token the slot's sequence
    # committed since its first proposal (position p of the slot is position p + shift there);
    # None before the first proposal
    matches: list[list[tuple[int, int]] | None]
    origins: list[int]  # per slot: the position of its sequence's first proposal
    starts: list[int]  # per slot: the position of its history's first token
    history: list[list[int]]  # per slot: its committed tokens from its start on
    last: list[tuple[int, list[int]] | None]  # per slot: its last proposal (position, tokens)
    missed = 0  # proposals with no agreeing sequence (the draft's own tokens went)
    reentered = 0  # proposals whose sequence was found again by its last tokens

    def set_oracle(self, table: OracleTable) -> None:
        self.oracle = table
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] | None = None
        self._reset(self.slots)

    def set_slots(self, slots: int) -> None:
        super().set_slots(slots)
        self._reset(slots)

    def _reset(self, slots: int) -> None:
        self.matches, self.origins, self.starts = [None] * slots, [0] * slots, [0] * slots
        self.history, self.last = [[] for _ in range(slots)], [None] * slots

    def begin(self, slot: int, sample: dict | None = None) -> None:
        super().begin(slot, sample)
        self.matches[slot], self.history[slot], self.last[slot] = None, [], None
        table = reread(self.oracle)
        if table is not self.oracle:
            self.oracle, self._index = table, None

    def propose(self, slot, token, pos, n, tokens=None, start=0, tree=0, kept=None):
        out = super().propose(slot, token, pos, n, tokens, start, tree, kept)
        return self._replace(slot, token, pos, out)

    def propose_batch(self, reqs: Sequence[tuple[int, int, int, int, int, list[int] | None]]):
        outs = super().propose_batch(reqs)
        return [self._replace(r[0], r[1], r[2], o) for r, o in zip(reqs, outs, strict=True)]

    def _committed_since(self, slot: int, token: int, pos: int) -> int:
        """Extend the slot's history to `pos` (the kept draft tokens of its last proposal, then
        `token`); the first position that is new to it. Tokens the draft never saw (plain
        steps between its proposals: `spec_policy` auto) start the history again at `pos`, the
        table looked up again from there."""
        hist, start, last = self.history[slot], self.starts[slot], self.last[slot]
        if last is None:  # (its first proposal)
            self.origins[slot] = self.starts[slot] = pos
            hist[:] = [token]
            return pos
        at, drafted = last
        if not start <= at <= pos <= at + len(drafted) + 1:
            self.starts[slot], self.matches[slot] = pos, None
            hist[:] = [token]
            return pos
        first = min(at + 1, pos)  # (pos == at: the same proposal asked again)
        hist[first - start:] = [*drafted[:pos - first], token]
        return first

    def _agreeing(self, slot: int, first: int, pos: int) -> list[tuple[int, int]]:
        """The slot's table sequences that also agree with its tokens at [first, pos]."""
        seqs, hist, start = self.oracle.sequences, self.history[slot], self.starts[slot]
        prev = self.matches[slot]
        if prev is None:
            prev = [(i, 0) for i in range(len(seqs))]
        out = []
        for i, shift in prev:
            s = seqs[i]
            if len(s) > pos + shift and all(s[p + shift] == hist[p - start]
                                            for p in range(first, pos + 1)):
                out.append((i, shift))
        return out

    def _lookup(self, slot: int, pos: int) -> list[tuple[int, int]]:
        """Table sequences whose tokens somewhere equal the slot's last `REENTRY` ones, as
        (sequence, shift) pairs with a continuation there; [] while it has fewer tokens."""
        hist = self.history[slot]
        if len(hist) < REENTRY:
            return []
        if self._index is None:
            self._index = {}
            for i, s in enumerate(self.oracle.sequences):
                for end in range(REENTRY - 1, len(s) - 1):
                    self._index.setdefault(tuple(s[end - REENTRY + 1:end + 1]), []).append(
                        (i, end))
        return [(i, end - pos) for i, end in self._index.get(tuple(hist[-REENTRY:]), ())]

    def _replace(self, slot: int, token: int, pos: int, out: tuple) -> tuple:
        drafted, parents, q = out
        if parents is not None or q is not None or self.sampling[slot] is not None:
            raise ValueError("bench oracle: greedy chains only (spec_tree 0, temperature 0)")
        seqs = self.oracle.sequences
        first = self._committed_since(slot, token, pos)
        was = self.matches[slot]
        cand = self._agreeing(slot, first, pos)
        if not cand and first < pos:  # (the tokens before `pos` need not be its proposal's:
            # plain steps between proposals, `spec_policy` auto): its history from `pos` on
            self.starts[slot], self.history[slot] = pos, [token]
            cand = self._agreeing(slot, pos, pos)
        if not cand:
            cand = self._lookup(slot, pos)
            if cand:
                self.reentered += 1
            elif was is None or any(len(seqs[i]) > pos + shift for i, shift in was):
                # (not past the end of its sequence, e.g. a proposal prepared after the last
                # token: no miss)
                log.warning("bench oracle: slot %d's sequence left the table at position %d "
                            "(no known output has token %d there): the draft's own tokens "
                            "until its last %d tokens are found in it again", slot, pos, token,
                            REENTRY)
                self.missed += 1
        self.matches[slot] = cand
        if not cand:
            self.last[slot] = (pos, list(drafted))
            return out
        i, shift = max(cand, key=lambda c: (c[0], -c[1]))  # (the sequence added last: the
        # latest pass's; of its places, the first: the longest continuation)
        seq = seqs[i]
        keep = self.oracle.committed(self.origins[slot], pos, len(drafted) + 1) - 1
        vocab = self.cfg.model.vocab_size
        new = []
        for j, own in enumerate(drafted):
            at = pos + shift + 1 + j
            if at >= len(seq):
                new.append(own)
            elif j < keep:
                new.append(seq[at])
            else:
                new.append((seq[at] + 1) % vocab)
        self.last[slot] = (pos, new)
        return new, None, None
