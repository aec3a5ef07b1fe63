"""Where prefill chunks start and end, and so where a KV snapshot can be taken and restored.

The numerics of a KV row depend on the chunk it was computed in (a matmul over 300 rows need not
round like one over 200). For a restored prefix to continue exactly as a cold run would, every
snapshot point must be a chunk boundary in *any* run whose prompt starts with that prefix. So the
cut set is a function of the tokens alone: every multiple of the chunk size, and the position just
after every end-of-turn token (a chat message boundary). The cuts up to P depend only on the first
P tokens, so a snapshot at a cut point P restores exactly into any longer prompt. A snapshot at a
non-cut point (the end of a prompt) is valid only for that exact prompt.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def cut_points(
    tokens: Sequence[int], chunk: int, turn_end_ids: Collection[int], end: int | None = None
) -> list[int]:
    """Sorted cut positions in (0, end]: multiples of `chunk` and positions after turn ends."""
    end = len(tokens) if end is None else end
    cuts = set(range(chunk, end + 1, chunk))
    cuts.update(turn_ends(tokens, turn_end_ids, end))
    return sorted(cuts)


def turn_ends(tokens: Sequence[int], turn_end_ids: Collection[int], end: int) -> list[int]:
    """The positions just after every turn-end token of tokens[:end], unsorted. (`list.index`
    scans in C: a 20K-token conversation's few turn ends are found in tens of microseconds,
    where a loop over every token took most of a millisecond.)"""
    seq = tokens if isinstance(tokens, (list, tuple)) else list(tokens[:end])
    out = []
    for t in set(turn_end_ids):
        i = -1
        try:
            while True:
                i = seq.index(t, i + 1, end)
                out.append(i + 1)
        except ValueError:
            pass
    return out


def prefill_chunks(
    tokens: Sequence[int], start: int, end: int, chunk: int, turn_end_ids: Collection[int]
) -> list[tuple[int, int]]:
    """Chunks [a, b) covering [start, end), split at every cut point (start must be a cut or 0)."""
    bounds = [start] + [c for c in cut_points(tokens, chunk, turn_end_ids, end) if c > start]
    if bounds[-1] != end:
        bounds.append(end)
    return list(zip(bounds[:-1], bounds[1:]))


def is_cut(tokens: Sequence[int], pos: int, chunk: int, turn_end_ids: Collection[int]) -> bool:
    return pos > 0 and (pos % chunk == 0 or tokens[pos - 1] in turn_end_ids)
