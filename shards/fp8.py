"""FP8 checkpoints: `quantization_config.quant_method = "fp8"`, the block-scaled layout of
transformers' FineGrainedFP8 (as DeepSeek-V3 and the Qwen3 -FP8 releases ship it): each quantized
linear's `weight` in float8 e4m3 and beside it `weight_scale_inv`, float32, one per block of
`weight_block_size` (rows, columns; the last blocks of a side that is not a multiple are partial,
as DeepSeek-V3's 576-row projections are). The stored value times its block's scale is the weight.

They are dequantized at load to the run dtype (`shards.checkpoint_hf`), with a warning that
says what that costs in memory, or kept in FP8 under `weight_format = "quantized"`
(`layers.fp8_linear`). Activations
are computed in the run dtype: transformers' FP8 kernels quantize them to FP8 per group of 128
(`activation_scheme = "dynamic"`), a second rounding this path does not make, so the reference
for parity is the dequantized weights'. Anything else in a `quantization_config` is refused by
name (`shards.quant_config`: a checkpoint read as if unquantized would answer with silently
wrong tokens).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layersplit.shards.errors import CheckpointError

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale_inv"  # `NAME.weight` -> `NAME.weight_scale_inv`
# projections whose weight a layer reads whole rather than through its module (latent
# attention's absorbed form, `layers.mla`): dequantized at load even when others are kept
NOT_KEPT = ("kv_b_proj.weight",)
_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size",
         "modules_to_not_convert", "dequantize", "scale_fmt"}
# (`scale_fmt`: how the FP8 GEMM kernels round activation scales, "ue8m0" for powers of two; the
# stored weight scales are floats whatever it says, and are read as stored)


def keeps(source: str) -> bool:
    """Whether `weight_format = "quantized"` keeps the FP8 tensor `source` in FP8: a
    projection's weight (`*_proj.weight`, the LM head) its module reads through `forward`."""
    return (source.endswith("_proj.weight") or source == "lm_head.weight") and \
        not source.endswith(NOT_KEPT)


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A projection's weight as an FP8 checkpoint stores it (kept so: `layers.fp8_linear`)."""

    values: torch.Tensor  # float8 e4m3 (rows, cols)
    scale: torch.Tensor  # float32, one per block
    block: tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """A checkpoint's FP8 layout: rows and columns of a scale's block."""

    block: tuple[int, int]


def fp8_scheme(q: dict[str, Any], source: str | Path) -> Fp8Scheme:
    """The FP8 layout of a `quantization_config` whose `quant_method` is "fp8"
    (`quant_config.quant_scheme`). Raises CheckpointError naming a format or key that is not
    implemented."""
    unknown = sorted(set(q) - _KEYS)
    if unknown:
        raise CheckpointError(f"{source}: quantization_config field(s) {unknown} are not "
                              "implemented for quant_method 'fp8'")
    if q.get("scale_fmt") not in (None, "ue8m0"):
        raise CheckpointError(f"{source}: quantization_config scale_fmt={q['scale_fmt']!r} is "
                              "not implemented (only 'ue8m0')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: quantization_config fmt={q['fmt']!r} is not "
                              "implemented (only 'e4m3')")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise CheckpointError(
            f"{source}: quantization_config activation_scheme={q['activation_scheme']!r} is not "
            "implemented (only 'dynamic': its static input scales would go unread)")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and
            all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{source}: quantization_config weight_block_size={block!r} must "
                              "be two positive integers (rows, columns of a scale's block)")
    return Fp8Scheme((block[0], block[1]))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of a weight of `shape` (leading dimensions kept: stacked
    experts), one scale per block, partial blocks counted."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """`weight` (float8 e4m3, (..., rows, cols)) times its blocks' `scale_inv`, in float32,
    then in `dtype`: transformers' Fp8Dequantize on whole blocks, to the bit; a partial block
    takes its own scale, as DeepSeek's `weight_dequant` and vLLM do (transformers refuses it).
    Stacked experts go one at a time (the float32 temporaries are one expert's)."""
    import torch
    if weight.dim() > 2:
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        for i in range(weight.shape[0]):
            out[i] = dequantize_fp8(weight[i], scale_inv[i], block, dtype)
        return out
    *_, rows, cols = weight.shape
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * s).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """(float8 e4m3 values, float32 `weight_scale_inv`) of a (rows, cols) weight, each block
    scaled so that its largest magnitude is e4m3's largest (448), as FP8 checkpoints are made
    (random-weight FP8 shapes, tests)."""
    import torch
    rows, cols = weight.shape
    sr, sc = scale_shape((rows, cols), block)
    pad = torch.zeros(sr * block[0], sc * block[1], device=weight.device)
    pad[:rows, :cols] = weight.float()
    blocks = pad.reshape(sr, block[0], sc, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(sr * block[0], sc * block[1])
    return q[:rows, :cols].to(torch.float8_e4m3fn), scale
