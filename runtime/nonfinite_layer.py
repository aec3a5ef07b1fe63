"""Which layer's output first went non-finite: the diagnosis `layersplit check` runs where our
logits held a NaN or an infinity (the serving path only sees the logits; this walks the layers).

One layer at a time is loaded, in the run's dtype on one device, and the token sequence is run
through it whole (eagerly, as a prefill): the first layer whose output rows hold a NaN or an
infinity is named. The walk needs one layer's weights in memory at a time, so it runs for a
model of any size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.dtypes import torch_dtype
from layersplit.shards.executor import RangeExecutor

log = logging.getLogger(__name__)


def first_nonfinite_layer(model: str | Path, dtype: str, device: str, tokens: Sequence[int],
                          random_seed: int = 0) -> str | None:
    """The first layer whose output holds a NaN or an infinity for `tokens` ("layer 12"; the
    last layer's output is the logits, after the final norm and head), None if none does."""
    ckpt = open_checkpoint(model, random_seed)
    layers = ckpt.config.num_layers
    x = torch.tensor(list(tokens), dtype=torch.long, device=device)
    for i in range(layers):
        part = load_layer_range(ckpt, i, i + 1, torch_dtype(dtype), device)
        ex = RangeExecutor(part, max_len=len(tokens) + 1, device=device, static_decode=False)
        with torch.no_grad():
            out = ex.run(x, 0, all_logits=True)
        finite = bool(torch.isfinite(out).all())
        del part, ex
        if not finite:
            return f"layer {i}" if i < layers - 1 else \
                f"layer {i} (the last: or the final norm and LM head after it)"
        x = out
    return None

