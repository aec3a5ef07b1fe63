"""Read a layer range's tensors from a checkpoint, the experts of a MoE layer in whichever layout
the checkpoint stores them.

Canonically (`shards.weights.moe_tensor_shapes`) a layer's experts are three 3-D tensors,
`mlp.experts.{gate,up,down}_proj` (E, I, H) / (E, H, I), and its router `mlp.gate.weight`. A
checkpoint may hold them:
- as such (GGUF's `ffn_{gate,up,down}_exps`, random weights);
- fused as transformers 5 keeps them in memory: `mlp.experts.gate_up_proj` (E, 2I, H, gate
  rows first) and `mlp.experts.down_proj`;
- per expert, as published checkpoints and transformers' `save_pretrained` write them:
  `mlp.experts.N.{gate,up,down}_proj.weight` (Qwen), or Mixtral's
  `block_sparse_moe.experts.N.{w1,w3,w2}.weight` with its router `block_sparse_moe.gate.weight`.
Only the tensors of the requested layers are read, whatever the layout.
"""

from __future__ import annotations

import re

import torch
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.weights import source_name

_EXPERT = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate|up|down)_proj$")
# per-expert layouts: (prefix under the layer, {canonical part: tensor name under the expert})
_PER_EXPERT = (
    ("mlp.experts.{e}.", {"gate": "gate_proj.weight", "up": "up_proj.weight",
                          "down": "down_proj.weight"}),
    ("block_sparse_moe.experts.{e}.", {"gate": "w1.weight", "up": "w3.weight",
                                       "down": "w2.weight"}),
)
_ROUTER_ALIASES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight")


def read_tensors(ckpt, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """`ckpt.load` of canonical `shapes`, assembling the experts from their stored layout."""
    part_shapes: dict[str, tuple[int, ...]] = {}
    part_sources: dict[str, str] = {}
    builds: dict[str, tuple[str, list[str]]] = {}  # canonical -> (how, part keys)

    def part(src: str, shape: tuple[int, ...]) -> str:
        part_shapes[src], part_sources[src] = shape, src
        return src

    for name, shape in shapes.items():
        src = source_name(cfg, name)
        m = _EXPERT.match(name)
        if ckpt.has(src):
            builds[name] = ("same", [part(src, shape)])
        elif name.endswith(_ROUTER_ALIASES[0]) and ckpt.has(
                alias := name.replace(*_ROUTER_ALIASES)):
            builds[name] = ("same", [part(alias, shape)])
        elif m is None:
            builds[name] = ("same", [part(src, shape)])  # missing: `load` names it
        else:
            builds[name] = _expert_parts(ckpt, name, m.group(1), m.group(2), shape, part)
    loaded = ckpt.load(part_shapes, part_sources, dtype, device)
    out: dict[str, torch.Tensor] = {}
    for name, (how, keys) in builds.items():
        if how == "same":
            out[name] = loaded[keys[0]]
        elif how == "stack":
            out[name] = torch.stack([loaded[k] for k in keys])
        else:  # a half of the fused gate/up tensor
            first = how == "gate"
            out[name] = loaded[keys[0]].chunk(2, dim=1)[0 if first else 1].contiguous()
    return out


def _expert_parts(ckpt, name: str, layer: str, which: str, shape: tuple[int, ...],
                  part) -> tuple[str, list[str]]:
    e, rows, cols = shape
    fused = layer + "mlp.experts.gate_up_proj"
    if which != "down" and ckpt.has(fused):
        fp8 = getattr(ckpt, "fp8", None)
        if fp8 is not None and rows % fp8.block[0]:  # (a block across the gate/up seam: the
            # two halves quantized apart or as one give the same scale grid, not the same values)
            raise CheckpointError(f"{ckpt.path}: {fused!r} is FP8 with blocks of {fp8.block[0]} "
                                  f"rows across its gate and up halves of {rows}: not "
                                  "implemented")
        return which, [part(fused, (e, 2 * rows, cols))]
    for prefix, names in _PER_EXPERT:
        first = layer + prefix.format(e=0) + names[which]
        if ckpt.has(first):
            return "stack", [part(layer + prefix.format(e=i) + names[which], (rows, cols))
                             for i in range(e)]
    raise CheckpointError(
        f"{ckpt.path}: no tensors for {name!r}: looked for it, for the fused "
        f"{fused!r} and for per-expert tensors such as "
        f"{', '.join(repr(layer + p.format(e=0) + n[which]) for p, n in _PER_EXPERT)}")
