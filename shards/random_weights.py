"""Seeded random weights for a model config, for speed work on published shapes.

Throughput does not depend on the values of the weights, so an 8B- or 32B-shape model needs no
checkpoint: each tensor is drawn from a generator seeded by (seed, tensor name), on the device
that will hold it. Every process therefore builds exactly the tensors of its own layer range,
and a 1-shard and a 2-shard run of the same seed hold identical weights.

A shape whose folder also holds `random.json` with `{"weights": "chain"}` draws *chain* weights
(the bench oracle's targets, `draft.oracle_table`): every tensor that writes into the residual
stream (attention's and the linear attention's output projections, the MLPs' and experts'
down projections) is scaled by `CHAIN_SCALE`, and the LM head is the embedding with its rows
permuted, so that the greedy next token of token t is `chain_successor(...)[t]` by a margin no
rounding closes. Gaussian random weights leave the top logits within rounding of each other
every few dozen tokens: a verify step of 16 rows and a plain step of one then disagree, and a
table of the plain run's tokens stops matching what the speculative run decodes. The shapes and
kernels are the same (a matmul's time does not depend on its values), so a chain target's step
costs what the Gaussian one's does.
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
RANDOM_SPEC = "random.json"  # a shape folder's choice of random values (chain weights)
CHAIN_SCALE = 1e-3  # the residual writers' scale in chain weights
_RESIDUAL_WRITERS = ("o_proj", "down_proj", "out_proj")
_POST_NORMED = ("gemma3_text",)  # families whose residual writers' outputs are normed


def preset_path(name: str) -> Path:
    """`random:NAME` -> configs/models/NAME (a folder with a config.json)."""
    p = PRESETS_DIR / name
    if not (p / "config.json").is_file():
        known = sorted(d.name for d in PRESETS_DIR.iterdir()) if PRESETS_DIR.is_dir() else []
        raise CheckpointError(f"random:{name}: no such model shape (known: {', '.join(known)})")
    return p


def random_folder(spec: str | Path) -> Path:
    """The shape folder of a `random:NAME` (a preset, `preset_path`) or a
    `random:/path/to/folder-with-config` model."""
    rest = str(spec).removeprefix("random:")
    return Path(rest) if "/" in rest else preset_path(rest)


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
        self.chain = config is None and read_random_spec(folder, self.config)

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
        if self.chain and name == "lm_head.weight":
            emb = self.tensor("model.embed_tokens.weight", shape, dtype, device)
            head = torch.empty_like(emb)
            head[chain_successor(shape[0], self.seed, device)] = emb  # (row succ[t] = e_t)
            return head
        g = torch.Generator(device=device)
        g.manual_seed(_generator_seed(name, self.seed))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=g, device=device)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g, device=device)
        else:
            t = self.std * torch.randn(shape, generator=g, device=device)
        if self.chain and any(w in name for w in _RESIDUAL_WRITERS):
            t = t * CHAIN_SCALE
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


def read_random_spec(folder: Path, config: ModelConfig) -> bool:
    """Whether the shape at `folder` draws chain weights (its `random.json`); every other
    key or value there is refused by name."""
    path = folder / RANDOM_SPEC
    if not path.is_file():
        return False
    try:
        spec = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON: {e}") from None
    if not isinstance(spec, dict) or set(spec) != {"weights"} or spec["weights"] != "chain":
        raise CheckpointError(f"{path}: expected {{\"weights\": \"chain\"}} (the only choice "
                              f"of random values), got {spec!r}")
    if config.tie_word_embeddings:
        raise CheckpointError(f"{path}: chain weights need an LM head of its own; this shape "
                              "ties it to the embedding (tie_word_embeddings)")
    if config.model_type in _POST_NORMED:  # (a norm after o_proj / down_proj undoes the scale)
        raise CheckpointError(f"{path}: chain weights scale the residual writers down, and "
                              f"{config.model_type} normalizes their outputs (sandwich norms)")
    return True


def _generator_seed(name: str, seed: int) -> int:
    """The generator seed of tensor `name` under `seed`. (A CPU generator reads only a seed's
    low 32 bits: the seed is mixed into them; seed 0 gives the tensors it always gave.)"""
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def chain_successor(vocab: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Chain weights' greedy next token of each token: a permutation of the vocabulary drawn
    from the seed (the cycle through a given token is shorter than n with probability
    n / vocab)."""
    import torch
    g = torch.Generator(device="cpu")
    g.manual_seed(_generator_seed("chain", seed))
    return torch.randperm(vocab, generator=g).to(device)
