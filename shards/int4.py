"""Int4 checkpoints: `quantization_config.quant_method = "gptq"` (as AutoGPTQ, GPTQModel and
optimum write them, `checkpoint_format` "gptq", their v1) and `"awq"` (AutoAWQ's `version`
"gemm"). Each quantized linear `X` of (out, in) = (N, K) is stored as

- GPTQ: `X.qweight` int32 (K/8, N), eight 4-bit values a word packed along the input dimension,
  the first in the low bits; `X.qzeros` int32 (G, N/8) packed the same way along the output
  dimension, each stored zero one less than the zero it means (v1's offset: AutoGPTQ subtracts
  1 before packing, its kernels and vLLM's add it back); `X.scales` float (G, N); `X.g_idx`
  int32 (K), the group of each input row (under `desc_act`, act order, a permutation of groups);
- AWQ: `X.qweight` int32 (K, N/8) and `X.qzeros` int32 (G, N/8), both packed along the output
  dimension in AutoAWQ's order (the word's i-th nibble, low bits first, holds column
  8c + [0, 2, 4, 6, 1, 3, 5, 7][i]); `X.scales` float (G, N); groups of consecutive rows,

G = K / `group_size` (-1: one group, the whole K; K a whole number of words of eight values). The
weight is (q - zero) * scale of the row's group, transposed to (N, K).

Both are first repacked into one layout (`repack_int4`, `Int4Weight`): rows = outputs, each row's
values packed along K into int32 words (low bits first), the zeros unpacked to a byte each (N, G),
the scales float32 (N, G), and `g_idx` kept only where it is not groups of consecutive rows (act
order). From that layout a weight is dequantized at load to the run dtype (`shards.
checkpoint_hf`, with a warning that says what that costs in memory), or kept so on the device
under `weight_format = "quantized"` (`layers.int4_linear`), where the GEMV reads a row's words
in order. The integer difference times a float16 scale is exact in float32, so a float32 run
holds the exact values either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layersplit.shards.errors import CheckpointError

if TYPE_CHECKING:
    import torch

METHODS = ("gptq", "awq")
PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of a word's i-th nibble, within its eight
_CHUNK = 1 << 24  # values dequantized at once (the temporaries: ~16 bytes a value)
# keys that say how a checkpoint was calibrated or which kernel to run, not how it is stored
_GPTQ_KEYS = {"damp_percent", "damp_auto_increment", "static_groups", "true_sequential",
              "model_name_or_path", "model_file_base_name", "use_exllama", "exllama_config",
              "use_cuda_fp16", "tokenizer", "dataset", "model_seqlen", "block_name_to_quantize",
              "module_name_preceding_first_block", "batch_size", "pad_token_id",
              "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize",
              "backend", "meta", "quantizer", "lm_head", "mse", "act_group_aware", "desc_act",
              "sym", "checkpoint_format", "format", "pack_dtype", "is_marlin_format", "dynamic",
              "adapter", "rotation", "modules_to_not_convert"}
_AWQ_KEYS = {"zero_point", "version", "format", "backend", "do_fuse", "fuse_max_seq_len",
             "modules_to_fuse", "modules_to_not_convert", "exllama_config"}
# keys that change the stored values where set: refused unless empty
_GPTQ_UNSET = ("dynamic", "adapter", "rotation", "is_marlin_format")


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Scheme:
    """A checkpoint's int4 layout: its method and the input rows a group spans (-1: all)."""

    method: str  # "gptq" or "awq"
    group_size: int
    desc_act: bool = False  # (GPTQ: groups in act order, `g_idx` a permutation)


def int4_scheme(q: dict[str, Any], source: str | Path) -> Int4Scheme:
    """The int4 layout of a `quantization_config` whose `quant_method` is "gptq" or "awq".
    Raises CheckpointError naming a bit width, format, version or key not implemented."""
    method = q["quant_method"]
    unknown = sorted(set(q) - {"quant_method", "bits", "group_size"}
                     - (_GPTQ_KEYS if method == "gptq" else _AWQ_KEYS))
    if unknown:
        raise CheckpointError(f"{source}: quantization_config field(s) {unknown} are not "
                              f"implemented for quant_method {method!r}")
    bits = q.get("bits")
    if bits != 4:
        raise CheckpointError(f"{source}: quantization_config bits={bits!r} is not implemented "
                              f"for quant_method {method!r} (only 4)")
    group = q.get("group_size")
    if not isinstance(group, int) or isinstance(group, bool) or not (group > 0 or group == -1):
        raise CheckpointError(f"{source}: quantization_config group_size={group!r} must be a "
                              "positive integer or -1 (one group)")
    return (_gptq(q, group, source) if method == "gptq" else _awq(q, group, source))


def _gptq(q: dict[str, Any], group: int, source: str | Path) -> Int4Scheme:
    fmt = {str(q[k]).lower() for k in ("checkpoint_format", "format") if q.get(k) is not None}
    if fmt - {"gptq"}:
        raise CheckpointError(
            f"{source}: quantization_config checkpoint_format={sorted(fmt)!r} is not "
            "implemented for quant_method 'gptq' (only 'gptq', v1: stored zeros one less)")
    for key in _GPTQ_UNSET:
        if q.get(key):
            raise CheckpointError(f"{source}: quantization_config {key}={q[key]!r} is not "
                                  "implemented for quant_method 'gptq'")
    if q.get("pack_dtype", "int32") != "int32":
        raise CheckpointError(f"{source}: quantization_config pack_dtype={q['pack_dtype']!r} "
                              "is not implemented (only 'int32')")
    return Int4Scheme("gptq", group, bool(q.get("desc_act")))


def _awq(q: dict[str, Any], group: int, source: str | Path) -> Int4Scheme:
    version = {str(q[k]).lower() for k in ("version", "format") if q.get(k) is not None}
    if version != {"gemm"}:
        raise CheckpointError(
            f"{source}: quantization_config version={sorted(version) or None!r} is not "
            "implemented for quant_method 'awq' (only 'gemm': AutoAWQ's GEMM packing)")
    if q.get("zero_point", True) is not True:
        raise CheckpointError(f"{source}: quantization_config zero_point={q['zero_point']!r} "
                              "is not implemented for quant_method 'awq' (only true)")
    return Int4Scheme("awq", group)


def part_shapes(scheme: Int4Scheme, prefix: str,
                shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The stored tensors of the linear `prefix` (`prefix.qweight`, ...) whose weight is of
    `shape` (out, in), and their shapes; refuses, naming the tensor, sides the packing or the
    groups do not divide."""
    if len(shape) != 2:
        raise CheckpointError(f"{prefix + '.qweight'!r}: int4 weights of shape {shape} (stacked "
                              "experts) are not implemented")
    n, k = shape
    group = k if scheme.group_size == -1 else scheme.group_size
    if k % group:
        raise CheckpointError(f"{prefix + '.qweight'!r}: quantization_config group_size "
                              f"{group} does not divide its {k} input columns")
    if n % 8 or k % 8:
        raise CheckpointError(f"{prefix + '.qweight'!r}: a weight of shape {shape} does not pack "
                              "into words of eight 4-bit values")
    g = k // group
    qweight = (k // 8, n) if scheme.method == "gptq" else (k, n // 8)
    shapes = {"qweight": qweight, "qzeros": (g, n // 8), "scales": (g, n), "g_idx": (k,)}
    return {f"{prefix}.{p}": shapes[p] for p in PARTS[scheme.method]}


def check_parts(scheme: Int4Scheme, prefix: str, parts: dict[str, torch.Tensor]) -> None:
    """Refuse, by name, stored int4 parts of the wrong dtype or a `g_idx` naming no group."""
    import torch
    for p in ("qweight", "qzeros", "g_idx"):
        t = parts.get(f"{prefix}.{p}")
        if t is not None and t.dtype != torch.int32:
            raise CheckpointError(f"{prefix + '.' + p!r} is stored as {t.dtype}, not int32")
    scales = parts[f"{prefix}.scales"]
    if not scales.dtype.is_floating_point:
        raise CheckpointError(f"{prefix + '.scales'!r} is stored as {scales.dtype}; int4 scales "
                              "must be floats")
    g_idx = parts.get(f"{prefix}.g_idx")
    if g_idx is not None:
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= scales.shape[0]):
            raise CheckpointError(f"{prefix + '.g_idx'!r} names groups outside 0..."
                                  f"{scales.shape[0] - 1}")


def _shifts(device: torch.device) -> torch.Tensor:
    """The shift of each of a word's eight nibbles."""
    import torch

    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Weight:
    """A linear's int4 weight in the one layout GPTQ and AWQ are repacked into (`repack_int4`):
    what `layers.int4_linear.Int4Linear` keeps on the device."""

    qweight: torch.Tensor  # int32 (N, K/8): row n's value k is nibble k % 8 of word k // 8
    zeros: torch.Tensor  # uint8 (N, G): the zero of each row's groups (GPTQ's offset added)
    scales: torch.Tensor  # float32 (N, G)
    g_idx: torch.Tensor | None  # int32 (K,): each input's group; None: k // group
    group: int  # input rows a group spans (without g_idx)


def repack_int4(scheme: Int4Scheme, parts: dict[str, torch.Tensor], prefix: str) -> Int4Weight:
    """The stored parts of the linear `prefix` (`part_shapes`, checked by `check_parts`; a GPTQ
    one without `g_idx`: groups of consecutive rows) in the kept layout: GPTQ's words
    transposed, AWQ's unpacked and packed again along K a slice of rows at a time; a `g_idx`
    that is groups of consecutive rows dropped."""
    import torch
    qweight, qzeros = parts[f"{prefix}.qweight"], parts[f"{prefix}.qzeros"]
    scales = parts[f"{prefix}.scales"].to(torch.float32)
    g, n = scales.shape
    if scheme.method == "gptq":
        k = qweight.shape[0] * 8
        words = qweight.t().contiguous()
        zeros = unpack_cols(qzeros) + 1  # (v1's offset)
    else:
        k = qweight.shape[0]
        cols = awq_columns(n, qweight.device)
        words = torch.empty(n, k // 8, dtype=torch.int32, device=qweight.device)
        step = max(8, _CHUNK // 4 // max(n, 1) // 8 * 8)
        for r in range(0, k, step):
            values = unpack_cols(qweight[r:r + step])[:, cols]  # (rows r.., N)
            words[:, r // 8:(r + step) // 8] = pack_rows(values).t()
        zeros = unpack_cols(qzeros)[:, cols]
    group = k // g
    g_idx = parts.get(f"{prefix}.g_idx")
    if g_idx is not None and torch.equal(
            g_idx.long(), torch.arange(k, device=g_idx.device) // group):
        g_idx = None  # (groups of consecutive rows: the GEMV finds them without a lookup)
    return Int4Weight(words, zeros.t().to(torch.uint8).contiguous(), scales.t().contiguous(),
                      None if g_idx is None else g_idx.to(torch.int32).contiguous(), group)


def quantize_int4(weight: torch.Tensor, group: int) -> Int4Weight:
    """A (N, K) weight rounded to int4 per group of `group` inputs (-1: all K), each group's
    range mapped onto 0..15 with its own scale and zero (asymmetric round-to-nearest), in the
    kept layout: random-weight int4 shapes, as GPTQ and AWQ files store such values."""
    import torch
    n, k = weight.shape
    group = k if group == -1 else group
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (w / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15).reshape(n, k)
    return Int4Weight(pack_rows(q.t()).t().contiguous(), zeros.to(torch.uint8), scales, None,
                      group)


def dequantize_packed(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor | None, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The (n, K) weight of rows of the kept layout (`Int4Weight`'s parts, those rows'):
    (q - zero) * scale in float32, then in `dtype`."""
    import torch
    k = qweight.shape[1] * 8
    groups = g_idx.long() if g_idx is not None else \
        torch.arange(k, device=qweight.device) // group
    q = unpack_cols(qweight)
    return ((q - zeros[:, groups]).to(torch.float32) * scales[:, groups]).to(dtype)


def dequantize_int4(scheme: Int4Scheme, parts: dict[str, torch.Tensor], prefix: str,
                    dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight of the linear `prefix` from its stored parts (as `repack_int4` takes
    them), in `dtype`: repacked, then dequantized a slice of output rows at a time (small
    temporaries)."""
    import torch
    w = repack_int4(scheme, parts, prefix)
    n, k = w.qweight.shape[0], w.qweight.shape[1] * 8
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    step = max(1, _CHUNK // max(k, 1))
    for r in range(0, n, step):
        out[r:r + step] = dequantize_packed(w.qweight[r:r + step], w.zeros[r:r + step],
                                            w.scales[r:r + step], w.g_idx, w.group, dtype)
    return out


def int4_bytes(scheme: Int4Scheme, shape: tuple[int, ...]) -> int:
    """Bytes the kept layout (`Int4Weight`) of an (N, K) weight takes: half a byte a value, a
    byte (zero) and four (scale) per row and group, and under `desc_act` four an input (`g_idx`;
    counted though one that is groups of consecutive rows is dropped at load)."""
    n, k = shape
    g = 1 if scheme.group_size == -1 else k // scheme.group_size
    return n * k // 2 + 5 * n * g + 4 * k * scheme.desc_act


def kept_layout_error(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group: int, g_idx: torch.Tensor | None, k: int) -> str | None:
    """What is wrong with the parts of a kept int4 weight (`Int4Weight`) taking rows of `k`
    inputs, said for an error (None: nothing)."""
    import torch
    n, g = (scales.shape if scales.dim() == 2 else (-1, -1))
    if k % 8 or qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, k // 8):
        return (f"int32 words {tuple(qweight.shape)} {qweight.dtype} are not (N, K/8) for "
                f"{k} inputs and {n} outputs")
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (n, g) or \
            scales.dtype != torch.float32:
        return (f"zeros {tuple(zeros.shape)} {zeros.dtype} and scales {tuple(scales.shape)} "
                f"{scales.dtype} are not (N, G) uint8 and float32")
    if g_idx is None and group * g != k:
        return f"{g} groups of {group} inputs are not {k} inputs"
    if g_idx is not None and (g_idx.dtype != torch.int32 or tuple(g_idx.shape) != (k,)):
        return f"g_idx {tuple(g_idx.shape)} {g_idx.dtype} is not int32 ({k},)"
    if not all(t.is_contiguous() for t in (qweight, zeros, scales)):
        return "the words, zeros and scales must be contiguous"
    return None


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 words -> (8R, C) values: row 8r + i is the i-th nibble (low bits first)."""
    nibbles = (packed[:, None, :] >> _shifts(packed.device)[None, :, None]) & 15
    return nibbles.reshape(-1, packed.shape[1])


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """(8R, C) values 0..15 -> (R, C) int32 words: `unpack_rows`' inverse."""
    import torch
    v = values.to(torch.int32).reshape(-1, 8, values.shape[1])
    out = v[:, 0].clone()
    for i in range(1, 8):
        out |= v[:, i] << (4 * i)
    return out


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 words -> (R, 8C) values: column 8c + i is the i-th nibble."""
    return ((packed[:, :, None] >> _shifts(packed.device)) & 15).reshape(packed.shape[0], -1)


def awq_columns(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The index that puts `unpack_cols` of AWQ words into column order: column 8c + j is
    nibble `AWQ_ORDER.index(j)` of word c."""
    import torch
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=device)
    return (torch.arange(0, n, 8, device=device)[:, None] + inverse).reshape(-1)
