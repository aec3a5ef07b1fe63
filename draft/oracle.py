"""The bench oracle's proposer (`draft.oracle_table` says what the oracle is and where its table
comes from): a DFlash proposer that computes every proposal, then replaces its tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from layersplit.draft.oracle_table import OracleTable, reread
from layersplit.draft.proposer import DFlashProposer

log = logging.getLogger(__name__)

class OracleProposer(DFlashProposer):
    """A `DFlashProposer` that computes every proposal and then replaces its tokens (from its
    table, `draft.oracle_table`). `oracle` must be set before the first proposal."""

    oracle: OracleTable
    matches: list[list[int] | None]  # per slot: the table sequences its proposals agree with
    origins: list[int]  # per slot: the position of its sequence's first proposal
    missed = 0  # proposals with no agreeing sequence (the draft's own tokens went)

    def set_oracle(self, table: OracleTable) -> None:
        self.oracle = table
        self.matches, self.origins = [None] * self.slots, [0] * self.slots

    def set_slots(self, slots: int) -> None:
        super().set_slots(slots)
        self.matches, self.origins = [None] * slots, [0] * slots

    def begin(self, slot: int, sample: dict | None = None) -> None:
        super().begin(slot, sample)
        self.matches[slot] = None
        self.oracle = reread(self.oracle)

    def propose(self, slot, token, pos, n, tokens=None, start=0, tree=0, kept=None):
        out = super().propose(slot, token, pos, n, tokens, start, tree, kept)
        return self._replace(slot, token, pos, out)

    def propose_batch(self, reqs: Sequence[tuple[int, int, int, int, int, list[int] | None]]):
        outs = super().propose_batch(reqs)
        return [self._replace(r[0], r[1], r[2], o) for r, o in zip(reqs, outs, strict=True)]

    def _replace(self, slot: int, token: int, pos: int, out: tuple) -> tuple:
        drafted, parents, q = out
        if parents is not None or q is not None or self.sampling[slot] is not None:
            raise ValueError("bench oracle: greedy chains only (spec_tree 0, temperature 0)")
        seqs = self.oracle.sequences
        prev = self.matches[slot]
        if prev is None:
            self.origins[slot] = pos
            prev = list(range(len(seqs)))
        cand = [i for i in prev if len(seqs[i]) > pos and seqs[i][pos] == token]
        if not cand:  # (past the end of its sequence, e.g. a proposal prepared after the last
            # token: no miss)
            if any(len(seqs[i]) > pos for i in prev):
                log.warning("bench oracle: slot %d's sequence left the table at position %d "
                            "(no known output has token %d there): the draft's own tokens "
                            "from here", slot, pos, token)
                self.missed += 1
                self.matches[slot] = cand
            return out
        self.matches[slot] = cand
        seq = seqs[cand[0]]
        keep = self.oracle.committed(self.origins[slot], pos, len(drafted) + 1) - 1
        vocab = self.cfg.model.vocab_size
        new = []
        for j, own in enumerate(drafted):
            at = pos + 1 + j
            if at >= len(seq):
                new.append(own)
            elif j < keep:
                new.append(seq[at])
            else:
                new.append((seq[at] + 1) % vocab)
        return new, None, None
