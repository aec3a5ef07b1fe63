"""A MoE layer's experts kept in their GGUF blocks (`ffn_{gate,up,down}_exps`, quantized by rows):
the `routed_moe.Experts` interface (`forward(x, w, idx)`, `fuse`) over blocks stacked by expert.

- Where the Triton kernels run, steps of up to `GROUPED_PAIRS` (token, expert) pairs run two
  grouped GEMVs that read only the chosen experts' blocks (gate/up with SiLU * up as its
  epilogue, then down), no host sync: a decode step in its CUDA graph.
- Elsewhere (CPU, long steps): `routed_moe.loop_experts`' order, each chosen expert's rows
  dequantized when it runs (bit-identical values, so float32 CPU runs equal the dequantized
  experts' exactly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.routed_moe import expert_groups, pair_outputs, sum_experts
from layersplit.shards.quant_blocks import dequantize_rows
from torch import nn

# (token, expert) pairs up to which a step on the kernels runs the grouped GEMVs (no host sync:
# the steps a CUDA graph holds, batches and verify trees among them); more (a prefill chunk):
# the experts one by one
GROUPED_PAIRS = 256


def _rows(blocks: torch.Tensor, lo: int, hi: int, qtype: str, k: int, dtype: torch.dtype,
          kernels: bool) -> torch.Tensor:
    """Rows lo:hi of a stacked matrix of `qtype` blocks, dequantized to `dtype`."""
    if kernels:
        from layersplit.shards.kernels.quant_gemv import dequantize

        return dequantize(blocks[lo:hi], qtype, k, dtype)
    return dequantize_rows(blocks[lo:hi], qtype).to(dtype)


class QuantExperts(nn.Module):
    """E SwiGLU experts of width I over a hidden size H: gate and up (E * I rows of H) and down
    (E * H rows of I) as uint8 block rows, gate and up interleaved by expert (E * 2I rows)
    where they are of one type."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 types: tuple[str, str, str], experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.e, self.h, self.i = experts, hidden, width
        self.gate_type, self.up_type, self.down_type = types
        self.fused = types[0] == types[1]
        if self.fused:  # expert e's gate rows, then its up rows
            self.register_buffer("gate_up", torch.cat(
                [gate.view(experts, width, -1), up.view(experts, width, -1)], dim=1,
            ).reshape(experts * 2 * width, -1))
        else:
            self.register_buffer("gate", gate.contiguous())
            self.register_buffer("up", up.contiguous())
        self.register_buffer("down", down.contiguous())
        self.kernels: bool | None = None  # the Triton kernels: decided at the first call

    def fuse(self) -> None:
        """(Nothing: the blocks are laid out for the GPU already.)"""

    def _gate_up(self, x: torch.Tensor, e: int, kernels: bool):
        i, h = self.i, self.h
        if self.fused:
            w = _rows(self.gate_up, 2 * i * e, 2 * i * (e + 1), self.gate_type, h, x.dtype,
                      kernels)
            return F.linear(x, w[:i]), F.linear(x, w[i:])
        g = _rows(self.gate, i * e, i * (e + 1), self.gate_type, h, x.dtype, kernels)
        u = _rows(self.up, i * e, i * (e + 1), self.up_type, h, x.dtype, kernels)
        return F.linear(x, g), F.linear(x, u)

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        from layersplit.shards.kernels.quant_gemv import quant_gemv

        n, k = idx.shape
        ids = idx.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)
        act = quant_gemv(xs, self.gate_up, self.gate_type, gate_up=True,
                         experts=(ids, 2 * self.i))
        y = quant_gemv(act, self.down, self.down_type, experts=(ids, self.h))
        y = y * w.reshape(-1, 1)
        return y.view(n, k, self.h).sum(dim=1).to(x.dtype)

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            self.kernels = fused_kernels_available(x.device)
        n, k = idx.shape
        if self.kernels and self.fused:
            from layersplit.shards.kernels.quant_gemv import EXPERT_ROWS

            if n * k <= GROUPED_PAIRS:  # (token, expert) pairs, token-major, in launches of
                # at most EXPERT_ROWS pairs
                step = max(1, EXPERT_ROWS // k)
                return torch.cat([self._grouped(x[a:a + step], w[a:a + step], idx[a:a + step])
                                  for a in range(0, n, step)])
        ys = pair_outputs(x, w, idx)  # as `routed_moe.loop_experts`
        for e, pick, rows in expert_groups(idx, self.e):
            g, u = self._gate_up(x[rows], e, bool(self.kernels))
            d = _rows(self.down, self.h * e, self.h * (e + 1), self.down_type, self.i, x.dtype,
                      bool(self.kernels))
            ys[pick] = F.linear(F.silu(g) * u, d) * w.reshape(-1)[pick, None]
        return sum_experts(ys, k, x.dtype)
