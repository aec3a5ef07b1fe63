"""Run dtypes by name (config files and the wire use names, not torch objects), and the rule
that picks one when the config says `auto` (`auto_dtype`; docs/models.md, "Dtypes")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


DTYPES = ("float32", "bfloat16", "float16")  # (the torch dtypes of the same names)

# Families whose activations overflow float16 (vLLM refuses float16 for these too): `auto` never
# gives them float16, whatever their checkpoint stores.
FLOAT16_UNSAFE = frozenset({"gemma3_text", "gemma2", "gemma3"})
# Families whose GPU paths have only been checked against transformers in bfloat16 (the hybrid
# Gated DeltaNet models, published in bfloat16): `auto` keeps them there.
BFLOAT16_ONLY = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
# Families whose float16 path was measured against transformers float32 on a GPU (the default
# model, a Llama): a GGUF file or a float32 checkpoint of one runs in float16, of any other
# family in bfloat16 (its range; a float16 checkpoint runs in float16 whatever its family).
FLOAT16_MEASURED = frozenset({"llama", "mistral"})


def torch_dtype(name: str) -> torch.dtype:
    if name in DTYPES:
        import torch

        return getattr(torch, name)
    raise ValueError(f"dtype {name!r} is not supported (use one of {', '.join(DTYPES)})")


def stored_dtype(path: str | Path) -> str | None:
    """The dtype a checkpoint's weights are stored in, as the `auto` rule reads it: an HF
    folder's (or a `random:` shape's) `torch_dtype` / `dtype` field; for a GGUF file, bfloat16
    if it holds a BF16 tensor, float32 if every tensor is F32, else None (F16 and the quantized
    types say nothing of the range the model was trained in: the family decides). None where
    nothing says."""
    from layersplit.shards.checkpoint import RANDOM_PREFIX

    spec = str(path)
    if spec.startswith(RANDOM_PREFIX):
        from layersplit.shards.random_weights import random_folder

        return _hf_dtype(random_folder(spec))
    p = Path(spec).expanduser()
    if p.is_dir():
        return _hf_dtype(p)
    if p.suffix == ".gguf" and p.is_file():
        from gguf import GGMLQuantizationType as Q
        from layersplit.shards.gguf_header import read_header

        types = {t.type for t in read_header(p).tensors.values()}
        if Q.BF16 in types:
            return "bfloat16"
        return "float32" if types and types <= {Q.F32} else None
    return None


def _hf_dtype(folder: Path) -> str | None:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # (opening the checkpoint says what is wrong with it)
    if not isinstance(raw, dict):
        return None
    if isinstance(raw.get("text_config"), dict):  # a multimodal folder's language model
        raw = {**raw["text_config"], **{k: v for k, v in raw.items() if k != "text_config"}}
    value = raw.get("torch_dtype") or raw.get("dtype")
    value = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16",
             "fp32": "float32"}.get(value, value)
    return value if value in DTYPES else None


def auto_dtype(model_type: str, stored: str | None, devices: list[str]) -> tuple[str, str]:
    """The run dtype `auto` gives (and why, for the log): float32 where every shard is a CPU;
    on GPUs the checkpoint's own half type where it stores one; for a GGUF file or a float32
    checkpoint, float16 on the families it was measured on (`FLOAT16_MEASURED`: it holds 3
    more mantissa bits than bfloat16 at the same speed, and on the default model bfloat16
    flips answers that transformers' float32 gets right: `layersplit check`'s measurements,
    bench/RESULTS.md, "Correctness"), bfloat16 on the others; and bfloat16 wherever float16
    is unsafe or unchecked (`FLOAT16_UNSAFE`, `BFLOAT16_ONLY`)."""
    if all(str(d) == "cpu" for d in devices):
        return "float32", "every shard is on a CPU"
    if model_type in FLOAT16_UNSAFE:
        return "bfloat16", f"{model_type} overflows float16"
    if model_type in BFLOAT16_ONLY:
        return "bfloat16", f"{model_type} runs in bfloat16 on GPUs"
    if stored in ("bfloat16", "float16"):
        return stored, f"the checkpoint stores {stored}"
    what = f"the checkpoint stores {stored}" if stored else "the checkpoint names no dtype"
    if model_type in FLOAT16_MEASURED:
        return "float16", f"{what}; float16 measured closest to float32 on {model_type}"
    return "bfloat16", f"{what}; float16 not measured on {model_type}"


def run_dtype(requested: str, model_type: str, path: str | Path,
              devices: list[str]) -> tuple[str, str]:
    """The dtype a run computes in: `requested` unless it is `auto` (`auto_dtype`)."""
    if requested != "auto":
        return requested, "as configured"
    return auto_dtype(model_type, stored_dtype(path), devices)
