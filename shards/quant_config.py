"""Which quantized layout a Hugging Face config.json's `quantization_config` declares: FP8 block
scales (`shards.fp8`) or GPTQ / AWQ int4 (`shards.int4`). Any other `quant_method` is refused
by name: a checkpoint read as if unquantized would answer with silently wrong tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layersplit.shards.errors import CheckpointError
from layersplit.shards.fp8 import Fp8Scheme, fp8_scheme
from layersplit.shards.int4 import METHODS, Int4Scheme, int4_scheme


def quant_scheme(raw: dict[str, Any], source: str | Path) -> Fp8Scheme | Int4Scheme | None:
    """The layout `raw` (a config.json) declares in its `quantization_config` (None: it has
    none). Raises CheckpointError naming a method, format or key that is not implemented."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: quantization_config={q!r} must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        return fp8_scheme(q, source)
    if method in METHODS:
        return int4_scheme(q, source)
    raise CheckpointError(
        f"{source}: quantization_config quant_method={method!r} is not implemented (FP8 "
        "checkpoints, quant_method 'fp8', and int4 ones, 'gptq' and 'awq', load; a GGUF file "
        "keeps its blocks: docs/models.md, FP8 checkpoints and GPTQ and AWQ checkpoints)")
