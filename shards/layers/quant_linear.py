"""Linear layers and embeddings whose weights stay in GGUF blocks (`shards.quant_blocks`).

`QuantLinear` stands where an `nn.Linear` stood (`quant_load.install_kept` swaps them after a
load):
- where the Triton kernels run (`kernels.fused_kernels_available`: CUDA), steps of up to
  `kernels.quant_gemv.MAX_ROWS` rows run the GEMV that dequantizes in registers
  (`shards.kernels.quant_gemv`);
- everywhere else (CPU; prefill chunks), `quant_matmul`: the weight dequantized a tile of
  output rows at a time to the activations' dtype (by the Triton kernel where the kernels
  run, in tiles of `tiled.KERNEL_TILE_ELEMENTS` values; by torch ops on a CPU, in tiles of
  `tiled.TILE_ELEMENTS`), then `F.linear`, so the dequantized copy alive at once is one tile
  (`layers.tiled`). In float32 on a CPU it is the same arithmetic as dequantizing
  at load (the tile's values are bit-identical), so the two paths' logits agree to float32
  summation order (`tests/shards/test_quant_linear.py`).

`QuantEmbedding` follows llama.cpp's `get_rows`: the rows of the looked-up tokens are
dequantized at each lookup; the table stays quantized.
"""

from __future__ import annotations

import torch
from layersplit.shards.kernels import fp8_kernels_available, fused_kernels_available
from layersplit.shards.layers.fp8_linear import Fp8Linear, concat_fp8
from layersplit.shards.layers.int4_linear import Int4Linear, concat_int4
from layersplit.shards.layers.tiled import tile_rows, tiled_linear
from layersplit.shards.quant_blocks import KEPT_TYPES, dequantize_rows, planar_sections
from torch import nn


def _torch_tile(blocks: torch.Tensor, qtype: str, k: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_rows(blocks, qtype).to(dtype)


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int,
                 bias: torch.Tensor | None = None, tile_elements: int | None = None,
                 kernels: bool = False, planar: bool = False) -> torch.Tensor:
    """F.linear of `x` (..., k) by the (n, k) matrix held as uint8 `blocks` (n, row_bytes),
    dequantized a tile of rows at a time to x's dtype (`kernels`: by the Triton kernel,
    `kernels.quant_gemv.dequantize`, one launch a tile, of planar rows where `planar`; else
    by torch ops), `tile_elements` values a tile at most (default `tiled.tile_rows`')."""
    if kernels:
        from layersplit.shards.kernels.quant_gemv import dequantize

        def tile_of(b, qtype, k, dtype):
            return dequantize(b, qtype, k, dtype, planar=planar)
    elif planar:
        raise ValueError("quant_matmul: planar rows are read by the Triton kernels only")
    else:
        tile_of = _torch_tile
    return tiled_linear(x, blocks.shape[0], tile_rows(k, kernels, 1, tile_elements),
                        lambda a, b: tile_of(blocks[a:b], qtype, k, x.dtype), bias)


def _row_bytes(qtype: str, k: int, planar: bool) -> int:
    return planar_sections(k, qtype)[3] if planar else KEPT_TYPES[qtype].row_bytes(k)


class QuantLinear(nn.Module):
    """y = x W^T + b with W (out_features, in_features) kept as `qtype` blocks (`planar`: K-quant
    rows repacked by `quant_blocks.to_planar`, read by the Triton kernels only)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None, planar: bool = False) -> None:
        super().__init__()
        if qtype not in KEPT_TYPES:
            raise ValueError(f"QuantLinear: type {qtype} is not kept quantized")
        want = _row_bytes(qtype, in_features, planar)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != want:
            raise ValueError(f"QuantLinear: {qtype} blocks of a row of {in_features} are "
                             f"(rows, {want}) uint8, got {tuple(blocks.shape)} {blocks.dtype}")
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.planar = qtype, planar
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernels: bool | None = None  # the Triton kernels: decided at the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            self.kernels = fused_kernels_available(x.device)
        if self.kernels:
            from layersplit.shards.kernels.quant_gemv import MAX_ROWS, quant_gemv

            rows = x.numel() // self.in_features
            if rows <= MAX_ROWS:
                y = quant_gemv(x.reshape(rows, self.in_features).contiguous(), self.blocks,
                               self.qtype, self.bias, planar=self.planar)
                return y.reshape(*x.shape[:-1], self.out_features)
        return quant_matmul(x, self.blocks, self.qtype, self.in_features, self.bias,
                            kernels=bool(self.kernels), planar=self.planar)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, planar={self.planar}, bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """A token embedding kept as `qtype` blocks (`planar`: as `QuantLinear`); each lookup
    dequantizes its rows to `dtype`."""

    def __init__(self, blocks: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype,
                 planar: bool = False) -> None:
        super().__init__()
        _row_bytes(qtype, dim, planar)  # (checks the row is whole blocks)
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.embedding_dim, self.dtype = qtype, dim, dtype
        self.planar = planar
        self.num_embeddings = blocks.shape[0]
        self.kernels: bool | None = None  # the Triton dequantizer: decided at the first call

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        if self.kernels is None:
            self.kernels = fused_kernels_available(rows.device)
        if self.kernels:  # (one launch where the torch ops are a dozen)
            from layersplit.shards.kernels.quant_gemv import dequantize

            out = dequantize(rows, self.qtype, self.embedding_dim, self.dtype,
                             planar=self.planar)
        elif self.planar:
            raise ValueError("QuantEmbedding: planar rows are read by the Triton kernels only")
        else:
            out = dequantize_rows(rows, self.qtype).to(self.dtype)
        return out.reshape(*ids.shape, -1)


class ConcatLinear(nn.Module):
    """Linears side by side (q/k/v or gate/up fused where the parts' types differ, as in
    Q4_K_M files: attn_v in Q6_K beside Q4_K q and k): one output, the parts' concatenated."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def concat_quant(parts: list[nn.Module]) -> nn.Module:
    """One module whose output is `parts`' outputs side by side, at least one of them a
    `QuantLinear` (or an `Fp8Linear`, an `Int4Linear`): their blocks concatenated where every
    part is of one type, else a `ConcatLinear` of runs of neighbours, each run of one type
    concatenated (a Q4_K_M layer's q and k in Q4_K beside v in Q6_K: two GEMVs, not three)."""
    first = parts[0]
    if isinstance(first, Fp8Linear):
        return concat_fp8(list(parts)) or ConcatLinear(list(parts))
    if isinstance(first, Int4Linear):
        return concat_int4(list(parts)) or ConcatLinear(list(parts))
    runs: list[list[nn.Module]] = []
    for p in parts:
        if runs and _joins(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [run[0] if len(run) == 1 else _cat_blocks(run) for run in runs]
    return merged[0] if len(merged) == 1 else ConcatLinear(merged)


def _joins(a: nn.Module, b: nn.Module) -> bool:
    """Whether `QuantLinear`s a and b can be one `QuantLinear` (one type and layout, each with
    a bias or neither)."""
    return isinstance(a, QuantLinear) and isinstance(b, QuantLinear) and \
        (a.qtype, a.planar, a.in_features, a.bias is None) == \
        (b.qtype, b.planar, b.in_features, b.bias is None)


def _cat_blocks(run: list[nn.Module]) -> QuantLinear:
    first = run[0]
    bias = None if first.bias is None else torch.cat([p.bias for p in run])
    return QuantLinear(torch.cat([p.blocks for p in run]), first.qtype, first.in_features,
                       bias, planar=first.planar)


# SiLU * up after a planar gate/up GEMV, not as its epilogue: chosen when the planar kernel
# with both halves' accumulators spilled registers on sm_90; the one of `kernels.quant_planar`
# now compiles without (144 registers at its launch shape, Triton 3.9), untimed against this
# route (`bench/quant_gemv.py`: `gate_up^` is this one, `gate_up*` the epilogue). The GEMV
# over all 2F rows then `row_ops.silu_mul` (one small kernel) compute the same roundings
# (`fused.rms_norm`'s, then SiLU's and the product's, as the epilogue does)
PLANAR_SILU_APART = True

KEPT_LINEARS = (Fp8Linear, Int4Linear)  # linears kept quantized that carry their own `gemv`


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, (QuantLinear, QuantEmbedding, ConcatLinear, *KEPT_LINEARS))


def gemv_takes(module: nn.Module, gate_up: bool = False) -> bool:
    """Whether `module_gemv` takes `module` (a gate/up projection: one `QuantLinear`, one
    `Fp8Linear` whose halves are whole scale blocks, or one `Int4Linear` of an even row count
    without a bias)."""
    if isinstance(module, QuantLinear):
        return True
    if isinstance(module, Fp8Linear):
        return fp8_kernels_available(module.weight.device) and (
            not gate_up or (module.out_features // 2) % module.block[0] == 0)
    if isinstance(module, Int4Linear):
        return fused_kernels_available(module.qweight.device) and (
            not gate_up or module.out_features % 2 == 0 and module.bias is None)
    return not gate_up and isinstance(module, ConcatLinear) and \
        all(isinstance(p, QuantLinear) or isinstance(p, KEPT_LINEARS) and gemv_takes(p)
            for p in module.parts)


def module_gemv(x: torch.Tensor, module: nn.Module, *,
                norm: tuple[torch.Tensor, float] | None = None,
                residual: torch.Tensor | None = None, gate_up: bool = False,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`kernels.gemv.gemv`'s options (the norm prologue, the residual and SiLU * up
    epilogues) on a module kept quantized (`gemv_takes`), through `kernels.quant_gemv` (an
    `Fp8Linear`, an `Int4Linear`: its own `gemv`, `kernels.fp8_gemv`, `kernels.int4_gemv`): a
    `ConcatLinear` is its parts' GEMVs, each into its columns of the result. A planar gate/up
    weight's SiLU * up is a kernel of its own (`PLANAR_SILU_APART`)."""
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    if isinstance(module, KEPT_LINEARS):
        return module.gemv(x, norm=norm, residual=residual, gate_up=gate_up,
                           out_dtype=out_dtype)
    if isinstance(module, QuantLinear):
        if gate_up and module.planar and residual is None and module.bias is None and \
                PLANAR_SILU_APART:  # (a bias: refused by `quant_gemv`, as gate/up takes none)
            from layersplit.shards.kernels import row_ops

            gu = quant_gemv(x, module.blocks, module.qtype, norm=norm, planar=True)
            act = row_ops.silu_mul(gu)
            return act if out_dtype in (None, act.dtype) else act.to(out_dtype)
        return quant_gemv(x, module.blocks, module.qtype, module.bias, norm=norm,
                          residual=residual, gate_up=gate_up, out_dtype=out_dtype,
                          planar=module.planar)
    if gate_up or residual is not None or not gemv_takes(module):
        raise ValueError("module_gemv: a ConcatLinear of QuantLinears takes a norm only")
    out = torch.empty(x.shape[0], module.out_features, dtype=out_dtype or x.dtype,
                      device=x.device)
    col = 0
    for p in module.parts:
        if isinstance(p, KEPT_LINEARS):
            p.gemv(x, norm=norm, out=out[:, col:col + p.out_features])
        else:
            quant_gemv(x, p.blocks, p.qtype, p.bias, norm=norm,
                       out=out[:, col:col + p.out_features], planar=p.planar)
        col += p.out_features
    return out
