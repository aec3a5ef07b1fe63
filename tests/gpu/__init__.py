"""GPU tests (marker `gpu`): run on a CUDA machine with `python -m pytest -m gpu`."""

from __future__ import annotations

import torch


def near(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Whether `a` is within `tol` of `b` per unit of `b`'s largest magnitude (at least 1): the
    tiny test models' logits and rows reach ~10, where float32 and bf16 rounding grow with
    them."""
    a, b = a.float().cpu(), b.float().cpu()
    return bool((a - b).abs().max() < tol * max(1.0, b.abs().max().item()))
