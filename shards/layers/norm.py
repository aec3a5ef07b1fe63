"""RMSNorm, computed in float32 as transformers does."""

from __future__ import annotations

import torch
from layersplit.shards.kernels import kernel_failed, try_kernel
from torch import nn


class RMSNorm(nn.Module):
    # one Triton kernel (`kernels.row_ops.rms_norm_rows`) on a GPU instead of eight eager
    # ones: set by `norms_as_row_kernels` for the layers that take the torch path there
    row_kernel = False
    float_product = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _row_kernel_takes(self, x: torch.Tensor) -> bool:
        return self.row_kernel and x.is_cuda and x.stride(-1) == 1 and x.numel() > 0 and \
            (self.float_product or self.weight.dtype == x.dtype) and not kernel_failed("norm")

    def _rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The row kernel's norm of `x`; None where it failed (then off, `try_kernel`)."""
        from layersplit.shards.kernels.row_ops import rms_norm_rows

        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = try_kernel("norm", rms_norm_rows, rows, self.weight, self.eps, self.float_product)
        return None if out is None else out.view(x.shape)

    def add_forward(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + x, this norm of it): one row kernel where the norm takes them (a residual add
        and the next norm of a layer off the fused step), else the two torch ops."""
        if self._row_kernel_takes(h) and h.dim() == 2 and x.shape == h.shape and \
                x.stride(-1) == 1 and x.dtype == h.dtype:
            from layersplit.shards.kernels.row_ops import add_rms_norm

            got = try_kernel("norm", add_rms_norm, h, x, self.weight, self.eps,
                             self.float_product)
            if got is not None:
                return got
        h = h + x
        return h, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._row_kernel_takes(x) and (out := self._rows(x)) is not None:
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored as an offset from 1 (zeros = identity), and the product
    taken in float32 before the cast back (Llama casts first)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class FloatProductRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: the weight multiplied in float32 before the cast back (Llama casts
    first; the same in float32)."""

    float_product = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._row_kernel_takes(x) and (out := self._rows(x)) is not None:
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def norms_as_row_kernels(module: nn.Module) -> int:
    """Switch the RMSNorms in `module` (`RMSNorm`, `FloatProductRMSNorm`) to the row kernel on a
    GPU; the number switched. For layers that run the torch path there (`shards.fused`): the
    fused steps fold their norms into other kernels."""
    norms = [m for m in module.modules() if type(m) in (RMSNorm, FloatProductRMSNorm)]
    for m in norms:
        m.row_kernel = True
    return len(norms)
