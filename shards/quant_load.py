"""Which tensors of a layer range stay quantized (`weights = "quantized"`), and the modules that
hold them in place of `nn.Linear` / `nn.Embedding`.

An FP8 checkpoint's projections (`layers.fp8_linear`) stay in FP8 with their block scales, a
GPTQ or AWQ one's in int4 with their zeros and scales (`layers.int4_linear`, repacked into one
layout: `int4.repack_int4`); their embedding, norms and anything stored unquantized are loaded
in the run dtype. Kept in their GGUF
blocks, as llama.cpp keeps them: every linear layer's weight (attention
q/k/v/o, the MLP's gate/up/down, a MoE layer's shared expert), the LM head (the embedding's
blocks when tied), the token embedding (rows dequantized at each lookup) and a MoE layer's
stacked experts (`layers.quant_experts`, where its gate, up and down are all quantized). Stay
as loaded today: norms and biases (F32 in GGUF files) and a MoE router.
"""

from __future__ import annotations

import math

import torch
from layersplit.shards.errors import CheckpointError
from layersplit.shards.fp8 import scale_shape
from layersplit.shards.int4 import int4_bytes
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.fp8_linear import Fp8Linear
from layersplit.shards.layers.int4_linear import Int4Linear
from layersplit.shards.layers.quant_experts import QuantExperts
from layersplit.shards.layers.quant_linear import QuantEmbedding, QuantLinear
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.quant_blocks import KEPT_TYPES, PLANAR_TYPES, planar_sections, to_planar
from layersplit.shards.weights import source_name
from torch import nn

EMBEDDING = "model.embed_tokens.weight"
PACK_ROWS = 2048  # rows repacked at once (`to_planar`'s temporaries: ~10 bytes a value)
EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


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


def load_kept(ckpt, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
              kept: dict[str, str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The stored form of the `kept` tensors (canonical name -> a GGUF file's uint8 rows, an
    FP8 checkpoint's `fp8.Fp8Weight`, or a GPTQ / AWQ one's `int4.Int4Weight`)."""
    return ckpt.load_blocks({n: shapes[n] for n in kept},
                            {n: source_name(cfg, n) for n in kept}, device)


def install_kept(model: nn.Module, blocks: dict[str, torch.Tensor], kept: dict[str, str],
                 dtype: torch.dtype) -> None:
    """Put a `QuantLinear` (`QuantEmbedding`) holding `blocks` where each kept tensor's
    `nn.Linear` (`nn.Embedding`) stands in `model` (a range loaded without those tensors), and
    a `QuantExperts` for each layer's kept experts. Where the Triton kernels run, the K types'
    blocks of the linears and the embedding are repacked into planar rows
    (`quant_blocks.to_planar`, the layout their GEMV reads fastest), once per tensor (a tied
    head and its embedding share them); the experts keep the stored rows."""
    planar: dict[int, torch.Tensor] = {}

    def rows(name: str, qtype: str) -> tuple[torch.Tensor, bool]:
        b = blocks[name]
        if qtype not in PLANAR_TYPES or not fused_kernels_available(b.device):
            return b, False
        if id(b) not in planar:  # (a few thousand rows at a time: bounded temporaries)
            planar[id(b)] = torch.cat([to_planar(b[r:r + PACK_ROWS], qtype)
                                       for r in range(0, b.shape[0], PACK_ROWS)])
        packed = planar[id(b)]
        for other in [k for k, v in blocks.items() if v is b]:  # (the stored rows freed as
            blocks[other] = packed  # they go: a tied head's embedding takes the same ones)
        planar[id(packed)] = packed
        return packed, True

    for name, qtype in kept.items():
        if name.endswith(EXPERTS):
            if name.endswith(EXPERTS[0]):
                _install_experts(model, blocks, kept, name[:-len(EXPERTS[0])])
            continue
        local = model.local_name(name)
        path, _, _ = local.rpartition(".")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if qtype == "FP8":  # (an FP8 checkpoint's projection: `layers.fp8_linear`)
            f = blocks[name]
            bias = old.bias if old.bias is not None and not old.bias.is_meta else None
            setattr(parent, attr, Fp8Linear(f.values, f.scale, f.block, bias))
            continue
        if qtype == "INT4":  # (a GPTQ / AWQ checkpoint's projection: `layers.int4_linear`)
            bias = old.bias if old.bias is not None and not old.bias.is_meta else None
            setattr(parent, attr, Int4Linear(blocks[name], bias))
            continue
        b, flat = rows(name, qtype)
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantEmbedding(b, qtype, old.embedding_dim, dtype, planar=flat)
        elif isinstance(old, nn.Linear):
            bias = old.bias if old.bias is not None and not old.bias.is_meta else None
            new = QuantLinear(b, qtype, old.in_features, bias, planar=flat)
        else:  # a bug in the name tables, not bad input
            raise RuntimeError(f"internal: {local} is held by a {type(old).__name__}")
        setattr(parent, attr, new)


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


AUTO_DEQUANTIZES = ("weight_format auto dequantizes while the quantized kernels are slower than "
                    "the dequantized weights; weight_format = quantized keeps the blocks")
AUTO_DEQUANTIZES_FP8 = ("weight_format auto dequantizes FP8 weights while their kernel's speed "
                        "is not measured; weight_format = quantized keeps them in FP8 (half the "
                        "memory of bfloat16)")
AUTO_DEQUANTIZES_INT4 = ("weight_format auto dequantizes GPTQ / AWQ int4 weights while their "
                         "kernel's speed is not measured; weight_format = quantized keeps them in "
                         "int4 (about a quarter of the memory of bfloat16)")


def _install_experts(model: nn.Module, blocks: dict[str, torch.Tensor], kept: dict[str, str],
                     prefix: str) -> None:
    names = [prefix + part for part in EXPERTS]
    path = model.local_name(names[0]).rpartition(".")[0]  # the `Experts` module
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    old = getattr(parent, attr)
    e, i, h = old.gate_proj.shape
    setattr(parent, attr, QuantExperts(*(blocks[n] for n in names),
                                       tuple(kept[n] for n in names), e, h, i))


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
