"""Run dtypes by name (config files and the wire use names, not torch objects)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported (use one of {', '.join(DTYPES)})")
