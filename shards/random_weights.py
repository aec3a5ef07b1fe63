"""Seeded random weights for a model config, for speed work on published shapes.

Throughput does not depend on the values of the weights, so an 8B- or 32B-shape model needs no
checkpoint: each tensor is drawn from a generator seeded by (seed, tensor name), on the device
that will hold it. Every process therefore builds exactly the tensors of its own layer range,
and a 1-shard and a 2-shard run of the same seed hold identical weights.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from layersplit.shards.errors import CheckpointError
from layersplit.shards.fp8 import Fp8Scheme, Fp8Weight, keeps, quantize_fp8
from layersplit.shards.int4 import Int4Scheme, Int4Weight, quantize_int4
from layersplit.shards.model_config import ModelConfig, read_hf_config
from layersplit.shards.quant_config import quant_scheme

if TYPE_CHECKING:
    import torch

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"


def preset_path(name: str) -> Path:
    """`random:NAME` -> configs/models/NAME (a folder with a config.json)."""
    p = PRESETS_DIR / name
    if not (p / "config.json").is_file():
        known = sorted(d.name for d in PRESETS_DIR.iterdir()) if PRESETS_DIR.is_dir() else []
        raise CheckpointError(f"random:{name}: no such model shape (known: {', '.join(known)})")
    return p


class RandomCheckpoint:
    def __init__(self, folder: Path, seed: int = 0, std: float = 0.02,
                 config: ModelConfig | None = None) -> None:
        self.path = folder
        # (`config`: a shape read elsewhere, e.g. a DFlash draft's layers, `draft.dflash`)
        self.config: ModelConfig = config or read_hf_config(folder)
        self.seed, self.std = seed, std
        # an FP8 or int4 shape (`quantization_config`: `shards.fp8`, `shards.int4`): its
        # projections' random values kept quantized under weight_format = "quantized"
        # (`load_blocks`), the values themselves where dequantized
        scheme = None if config is not None or self.config.gpt_oss is not None else \
            quant_scheme(json.loads((folder / "config.json").read_text()), folder)  # (gpt_oss:
        # its own quantization_config, MXFP4)
        self.fp8 = scheme if isinstance(scheme, Fp8Scheme) else None
        self.int4 = scheme if isinstance(scheme, Int4Scheme) else None

    @property
    def keeps_quantized(self) -> bool:
        return self.fp8 is not None or self.int4 is not None

    def kept_type(self, source: str) -> str | None:
        """"FP8" ("INT4") for a projection of an FP8 (int4) shape
        (`checkpoint_hf.HFCheckpoint.kept_type`)."""
        if not self.keeps_quantized:
            raise CheckpointError(
                f"{self.path}: weight_format = \"quantized\" keeps a GGUF file's blocks or an "
                "FP8, GPTQ or AWQ checkpoint's values; this random-weight shape has none of them "
                "(use weight_format = \"auto\" or \"dequantize\")")
        if not keeps(source) or source == "lm_head.weight":  # (the head stays unquantized, as
            return None  # the published FP8, GPTQ and AWQ checkpoints keep it)
        return "FP8" if self.fp8 is not None else "INT4"

    def load_blocks(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                    device: torch.device | str = "cpu") -> dict[str, Fp8Weight | Int4Weight]:
        """The random values of the kept projections, quantized to FP8 with block scales, or
        to int4 per group (`int4.quantize_int4`)."""
        import torch
        out = {}
        for name, src in sources.items():
            w = self.tensor(src, shapes[name], torch.float32, device)
            if self.int4 is not None:
                out[name] = quantize_int4(w, self.int4.group_size)
                continue
            q, s = quantize_fp8(w, self.fp8.block)
            out[name] = Fp8Weight(q, s, self.fp8.block)
        return out

    def has(self, name: str) -> bool:
        return True

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
        import torch
        g = torch.Generator(device=device)
        # (a CPU generator reads only a seed's low 32 bits: the seed is mixed into them; seed 0
        # gives the tensors it always gave)
        g.manual_seed(zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=g, device=device)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g, device=device)
        else:
            t = self.std * torch.randn(shape, generator=g, device=device)
        return t.to(dtype)

    def load(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
             dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        made: dict[str, torch.Tensor] = {}
        for name, src in sources.items():
            if src not in made:
                made[src] = self.tensor(src, shapes[name], dtype, device)
            out[name] = made[src]
        return out
