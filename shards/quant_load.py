"""The modules that hold the tensors kept quantized (`weights = "quantized"`; which ones:
`shards.quant_plan`) in place of `nn.Linear` / `nn.Embedding`.

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

import torch
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.fp8_linear import Fp8Linear
from layersplit.shards.layers.int4_linear import Int4Linear
from layersplit.shards.layers.quant_experts import QuantExperts
from layersplit.shards.layers.quant_linear import QuantEmbedding, QuantLinear
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.quant_blocks import PLANAR_TYPES, to_planar
from layersplit.shards.quant_plan import EXPERTS
from layersplit.shards.weights import source_name
from torch import nn

PACK_ROWS = 2048  # rows repacked at once (`to_planar`'s temporaries: ~10 bytes a value)


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


