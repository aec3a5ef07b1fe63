"""Which tensors of a layer range stay quantized (`weights = "quantized"`) and the bytes they
take: what the coordinator plans a split with, before any shard loads them
(`shards.quant_load` builds the modules that hold them)."""

from __future__ import annotations

import math

from layersplit.shards.errors import CheckpointError
from layersplit.shards.fp8 import scale_shape
from layersplit.shards.int4 import int4_bytes
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.quant_blocks import KEPT_TYPES, PLANAR_TYPES, planar_sections
from layersplit.shards.weights import source_name

EMBEDDING = "model.embed_tokens.weight"
EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
AUTO_DEQUANTIZES = ("weight_format auto dequantizes while the quantized kernels are slower than "
                    "the dequantized weights; weight_format = quantized keeps the blocks")
AUTO_DEQUANTIZES_FP8 = ("weight_format auto dequantizes FP8 weights while their kernel's speed "
                        "is not measured; weight_format = quantized keeps them in FP8 (half the "
                        "memory of bfloat16)")
AUTO_DEQUANTIZES_INT4 = ("weight_format auto dequantizes GPTQ / AWQ int4 weights while their "
                         "kernel's speed is not measured; weight_format = quantized keeps them in "
                         "int4 (about a quarter of the memory of bfloat16)")


def _kept_name(name: str, shape: tuple[int, ...]) -> bool:
    if len(shape) == 3:
        return name.endswith(EXPERTS)
    return len(shape) == 2 and (name.endswith("_proj.weight") or name in
                                ("lm_head.weight", EMBEDDING))


def kept_tensors(ckpt, cfg: ModelConfig,
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Canonical name -> block type of the tensors of `shapes` kept quantized."""
    if not hasattr(ckpt, "kept_type"):
        raise CheckpointError(f"{ckpt.path}: weight_format = \"quantized\" keeps a GGUF "
                              "file's blocks or an FP8, GPTQ or AWQ checkpoint's values; this "
                              "checkpoint is none of them (use weight_format = \"auto\" or "
                              "\"dequantize\")")
    out: dict[str, str] = {}
    for name, shape in shapes.items():
        if _kept_name(name, shape) and (qtype := ckpt.kept_type(source_name(cfg, name))):
            out[name] = qtype
    for name in [n for n in out if n.endswith(EXPERTS[0])]:  # a layer's experts: all or none
        trio = [name[:-len(EXPERTS[0])] + part for part in EXPERTS]
        if not all(n in out for n in trio):
            for n in trio:
                out.pop(n, None)
    return out


def resolve_weight_format(asked: str, ckpt, devices: list[str]) -> tuple[str, str]:
    """("quantized" or "dequantize", why) for config `weight_format` = `asked`. "quantized" on
    a checkpoint that is neither a GGUF file nor FP8, GPTQ or AWQ, or with a tensor of a type
    not kept, is refused by name (`kept_tensors`); "auto" dequantizes: the quantized kernels,
    exact on a GPU, are still slower than the dequantized weights there (bench/RESULTS.md;
    FP8's and int4's not measured yet), so they are taken only when asked."""
    from layersplit.shards.weights import range_tensor_shapes

    if asked == "dequantize":
        return asked, "asked"
    cfg = ckpt.config
    shapes = range_tensor_shapes(cfg, 0, cfg.num_layers)
    if asked == "quantized":
        kept_tensors(ckpt, cfg, shapes)  # (refuses what it cannot keep)
        return asked, "asked"
    if not getattr(ckpt, "keeps_quantized", hasattr(ckpt, "kept_type")):
        return "dequantize", "not a GGUF file nor an FP8, GPTQ or AWQ checkpoint"
    if getattr(ckpt, "fp8", None) is not None:
        return "dequantize", AUTO_DEQUANTIZES_FP8
    if getattr(ckpt, "int4", None) is not None:
        return "dequantize", AUTO_DEQUANTIZES_INT4
    return "dequantize", AUTO_DEQUANTIZES


def kept_bytes(ckpt, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
               itemsize: int) -> int:
    """Bytes `shapes` take on the device with weights kept quantized: the kept tensors' blocks,
    the rest at `itemsize`; K-quant rows at their planar size where larger (a GPU repacks
    them at load, `quant_blocks.to_planar`: the plan covers either layout); int4 weights as
    `int4.Int4Weight` holds them (`int4_bytes`)."""
    kept = kept_tensors(ckpt, cfg, shapes)
    total = 0
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        if name in kept and kept[name] == "FP8":  # (a byte a value, a float32 a block)
            bn, bk = ckpt.fp8.block
            total += n + 4 * math.prod(scale_shape(shape, (bn, bk)))
        elif name in kept and kept[name] == "INT4":
            total += int4_bytes(ckpt.int4, shape)
        elif name in kept:
            t, k = kept[name], shape[-1]
            row = KEPT_TYPES[t].row_bytes(k)
            if t in PLANAR_TYPES:
                row = max(row, planar_sections(k, t)[3])
            total += n // k * row
        else:
            total += n * itemsize
    return total
