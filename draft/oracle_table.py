"""The bench oracle: a DFlash draft whose proposals are the target's own greedy continuation.

For benchmarks only (`bench/speculative.py --oracle-acceptance A`): it measures what
speculation gains at a given acceptance on targets whose drafts we cannot train (random weights
of a published shape). The draft network really runs, at its full size, on the feature rows the
shards send, and its proposal then goes through the verify step, the kept-row moves and the
hops as any other; only its tokens are replaced. They come from a table of sequences (prompt +
the plain greedy run's tokens, computed before), and each proposal keeps the first k of them
right and makes the rest wrong, k chosen per proposal so that the committed tokens per verify
step (k + 1) have mean A: floor(A) or floor(A) + 1, placed on a lattice of positions
(`OracleTable.committed`), so that even a short run measures A.

The draft process reads the table from `$LAYERSPLIT_BENCH_ORACLE` (a JSON file:
`{"acceptance": A, "seed": S, "sequences": [[token, ...], ...]}`), again at a sequence's start
where the file changed; `layersplit generate` and
`serve` refuse to start while it is set (`refuse_in_product`), so no normal run speculates
with it. Which sequence a slot decodes is found from what its proposals are asked after (the
token at each position): the first table sequence that agrees with all of them. Greedy chains
only: a sampled request's or a tree's proposal is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

ORACLE_ENV = "LAYERSPLIT_BENCH_ORACLE"


@dataclasses.dataclass(frozen=True)
class OracleTable:
    acceptance: float  # the mean committed tokens per verify step to aim at
    sequences: tuple[tuple[int, ...], ...]  # prompt + plain greedy continuation
    seed: int = 0
    source: Path | None = None  # the file it was read from
    stamp: int = 0  # the file's mtime (ns) then

    def committed(self, origin: int, pos: int, most: int) -> int:
        """Committed tokens (right draft tokens + 1), at most `most`, for the proposal after
        position `pos` of a sequence whose first proposal came after `origin`: up to the next
        boundary origin + floor(k * A + u) (u in [0, 1) from the seed), so that rounds that
        start on a boundary commit floor(A) or floor(A) + 1 tokens with mean exactly A, and a
        round cut short (a request's last) puts the next back on the lattice."""
        a, u = self.acceptance, random.Random(self.seed).random()

        def boundary(k: int) -> int:
            return origin + math.floor(k * a + u)

        k = max(1, math.floor((pos - origin) / a))
        while boundary(k) <= pos:
            k += 1
        while k > 1 and boundary(k - 1) > pos:
            k -= 1
        return max(1, min(most, boundary(k) - pos))


def read_oracle(path: str | Path) -> OracleTable:
    """The table at `path`; every error names the file and the field."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{ORACLE_ENV}={path}: cannot read JSON: {e}") from e
    a = raw.get("acceptance") if isinstance(raw, dict) else None
    seqs = raw.get("sequences") if isinstance(raw, dict) else None
    if not isinstance(a, (int, float)) or not a >= 1:
        raise ValueError(f"{ORACLE_ENV}={path}: acceptance must be a number >= 1, got {a!r}")
    if not isinstance(seqs, list) or not all(
            isinstance(s, list) and all(isinstance(t, int) for t in s) for s in seqs):
        raise ValueError(f"{ORACLE_ENV}={path}: sequences must be lists of token ids")
    return OracleTable(float(a), tuple(tuple(s) for s in seqs), int(raw.get("seed", 0)),
                       Path(path), Path(path).stat().st_mtime_ns)


def reread(table: OracleTable) -> OracleTable:
    """The table again where its file changed since (the bench adds the sequences a
    speculative pass produced where it left the plain ones: `bench/speculative.py`)."""
    if table.source is None or table.source.stat().st_mtime_ns == table.stamp:
        return table
    return read_oracle(table.source)


def bench_oracle() -> OracleTable | None:
    """The table `$LAYERSPLIT_BENCH_ORACLE` names, or None when it is not set."""
    path = os.environ.get(ORACLE_ENV)
    return read_oracle(path) if path else None


def refuse_in_product() -> None:
    """A normal run (`layersplit generate`, `serve`) never speculates with the bench oracle."""
    if os.environ.get(ORACLE_ENV):
        raise SystemExit(f"{ORACLE_ENV} is set: the bench oracle draft is for "
                         "bench/speculative.py only; unset it to run layersplit")


