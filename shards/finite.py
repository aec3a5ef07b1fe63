"""Logits that hold a NaN or an infinity never become a token: the last shard fails that
sequence's part of the step instead (its outcome's `error`; the step's other sequences go on),
naming the dtype the shards compute in (a half type that overflowed, most often).

A plain greedy draw checks only its own logit: a NaN anywhere in a row wins the row's maximum
(torch's max and argmax propagate NaN), and so does an infinity, so the drawn logit is
non-finite whenever the row is. Every other draw (sampled, verify, logits processors) checks
its whole rows: a softmax spreads a NaN over every probability, and the draw may then land on
a token whose own logit is finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from layersplit.shards.kernels import (
    fused_kernels_available,
    kernel_failed,
    switched_off,
    try_kernel,
)

ARGMAX = "greedy draw"  # (`try_kernel`'s name of `kernels.row_argmax`)
ARGMAX_SWITCH = "LAYERSPLIT_ROW_ARGMAX"  # 0: the greedy draw as torch's max and marks


class NonFiniteLogits(RuntimeError):
    """A step's logits went non-finite; nothing was sampled from them."""


def greedy_draw(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of each row (n, V), and the same ids with -1 where the row's maximum is NaN or
    infinite: both stay on the device (no wait for it). Where the Triton kernels run, two
    launches (`kernels.row_argmax`) for torch's three."""
    if fused_kernels_available(rows.device) and not kernel_failed(ARGMAX) and \
            not switched_off(ARGMAX_SWITCH):
        from layersplit.shards.kernels.row_argmax import row_argmax, takes

        if takes(rows) and (got := try_kernel(ARGMAX, row_argmax, rows)) is not None:
            return got
    top, ids = rows.max(dim=-1)
    return ids, ids.masked_fill(~torch.isfinite(top), -1)


def mark_rows(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`ids` (one per row of `rows`) with -1 where the row holds a NaN or an infinity."""
    return ids.masked_fill(~torch.isfinite(rows).all(dim=-1), -1)


def bad_segments(rows: Sequence[torch.Tensor]) -> list[int]:
    """Which of the segments' rows (each (k, V)) hold a NaN or an infinity: one wait for the
    device for all of them."""
    if not rows:
        return []
    ok = torch.stack([torch.isfinite(r).all() for r in rows]).tolist()
    return [i for i, good in enumerate(ok) if not good]


def nonfinite_error(dtype: str, positions: Sequence[int], layers: str) -> NonFiniteLogits:
    where = ", ".join(str(p) for p in positions)
    return NonFiniteLogits(
        f"the logits at position {where} hold NaN or infinity (computed in {dtype}; this last "
        f"shard holds layers {layers}): nothing was sampled. A half type that overflows does "
        "this: run with --dtype float32 (or bfloat16 where float16 overflowed); `layersplit "
        "check` with this model and dtype names the first layer whose output went non-finite")
