"""The projections of layers that run the torch path on a GPU (`shards.fused`: the families
it does not fuse, e.g. latent attention, sinks, grouped routing), their steps of few rows
through the GEMV kernel (`kernels.gemv`) instead of cuBLAS.

At one row cuBLAS runs a GEMV as one or two kernels (a split-K product and its reduction),
~6-9 us each on an H200 for a DeepSeek-V2-Lite projection; the Triton GEMV reads the weight
once in one launch, as the fused Llama-layout step's projections do. `linears_as_gemv` switches
a layer's plain `nn.Linear`s (weights not kept quantized) to `GemvLinear`: same parameters and
state-dict names, the same math (float32 sums rounded once to the input's dtype); more rows
than `kernels.gemv_max_rows` (prefill chunks) take `F.linear` as before, and a kernel that
fails once is off for the process (`try_kernel`, named "GEMV").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import (
    fused_kernels_available,
    gemv_kernels_available,
    gemv_max_rows,
    kernel_failed,
    try_kernel,
)
from layersplit.shards.layers.norm import RMSNorm
from torch import nn

KERNEL = "GEMV"


def _gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gate_up: bool,
          residual: torch.Tensor | None = None,
          norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    from layersplit.shards.kernels.gemv import gemv  # (Triton: imported where it runs)

    return gemv(x, w, bias=bias, gate_up=gate_up, residual=residual, norm=norm)


class GemvLinear(nn.Linear):
    """An `nn.Linear` whose few-row steps on a GPU take the GEMV kernel (see the module)."""

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and 1 <= x.shape[0] <= gemv_max_rows() and x.stride(1) == 1 and \
            x.dtype == self.weight.dtype and not kernel_failed(KERNEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes(x) and (y := try_kernel(KERNEL, _gemv, x, self.weight, self.bias,
                                              False)) is not None:
            return y
        return F.linear(x, self.weight, self.bias)

    def add_to(self, r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """r + self(x), the add in the GEMV's launch where it takes x (the projection rounded,
        then the sum, as the two torch ops)."""
        if self.takes(x) and r.shape == (x.shape[0], self.out_features) and \
                r.stride(-1) == 1 and r.dtype == x.dtype and \
                (y := try_kernel(KERNEL, _gemv, x, self.weight, self.bias, False, r)) is not None:
            return y
        return r + F.linear(x, self.weight, self.bias)

    def normed(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """self(norm(x)): a plain RMSNorm of x's dtype (`layers.norm.RMSNorm`, whose rounding
        the GEMV's prologue follows) in the GEMV's launch where it takes x; else the two."""
        if type(norm) is RMSNorm and norm.weight.dtype == x.dtype and \
                norm.weight.is_contiguous() and self.takes(x) and \
                (y := try_kernel(KERNEL, _gemv, x, self.weight, self.bias, False, None,
                                 (norm.weight, norm.eps))) is not None:
            return y
        return self(norm(x))

    def silu_gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(g) * u of this fused gate/up projection's output, in the same launch (`gemv`'s
        `gate_up`); None where the kernel does not take x (the caller runs the torch ops)."""
        if self.bias is not None or not self.takes(x):
            return None
        return try_kernel(KERNEL, _gemv, x, self.weight, None, True)


def linears_as_gemv(module: nn.Module) -> int:
    """Switch the plain `nn.Linear`s in `module` (contiguous weights on a device where the
    kernels run: a GPU, or Triton's interpreter) to `GemvLinear`; the number switched."""
    if not gemv_kernels_available():
        return 0
    found = [m for m in module.modules() if type(m) is nn.Linear and m.weight.dim() == 2 and
             m.weight.is_contiguous() and fused_kernels_available(m.weight.device)]
    for m in found:
        m.__class__ = GemvLinear
    return len(found)
