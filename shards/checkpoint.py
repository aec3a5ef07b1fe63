"""Open a checkpoint (HF folder or GGUF file) and build a `LayerRange` holding only its tensors."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.quant_plan import kept_tensors
from layersplit.shards.weights import range_tensor_shapes

if TYPE_CHECKING:
    import torch
    from layersplit.shards.models import LayerRange

log = logging.getLogger(__name__)


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig

    def has(self, name: str) -> bool: ...

    def load(
        self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]: ...


RANDOM_PREFIX = "random:"


def open_checkpoint(path: str | Path, seed: int = 0) -> Checkpoint:
    """An HF folder, a .gguf file, or `random:NAME` / `random:/path/to/folder-with-config`
    (seeded random weights of that shape, for speed work)."""
    if str(path).startswith(RANDOM_PREFIX):
        from layersplit.shards.random_weights import RandomCheckpoint, random_folder

        return RandomCheckpoint(random_folder(path), seed)
    p = Path(path).expanduser()
    if p.is_dir():
        from layersplit.shards.checkpoint_hf import HFCheckpoint

        return HFCheckpoint(p)
    if p.is_file() and p.suffix == ".gguf":
        from layersplit.shards.checkpoint_gguf import GGUFFile

        return GGUFFile(p)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    raise CheckpointError(f"{p}: expected a Hugging Face model folder or a .gguf file")


def load_layer_range(
    ckpt: Checkpoint,
    start: int,
    end: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    weights: str = "dequantize",
) -> LayerRange:
    """Build layers [start, end) of `ckpt`, reading only the tensors that range needs.
    `dtype`: float32 if None. `weights`: "dequantize" (every tensor in `dtype`) or "quantized"
    (a GGUF file's linear weights kept in their blocks: `shards.quant_load`). (torch and the
    model code are imported here: the coordinator opens checkpoints without them.)"""
    import torch
    from layersplit.shards.expert_weights import read_tensors
    from layersplit.shards.models import LayerRange
    from layersplit.shards.models.qwen3_5 import HybridRange
    from layersplit.shards.models.registry import family_module
    from layersplit.shards.quant_load import install_kept, load_kept

    if dtype is None:
        dtype = torch.float32
    cfg = ckpt.config
    if not 0 <= start < end <= cfg.num_layers:
        raise CheckpointError(
            f"{ckpt.path}: layer range {start}:{end} is outside the model's {cfg.num_layers} layers"
        )
    t0 = time.perf_counter()
    shapes = range_tensor_shapes(cfg, start, end)
    if weights not in ("dequantize", "quantized"):
        raise ValueError(f"weights={weights!r}: expected 'dequantize' or 'quantized'")
    kept = kept_tensors(ckpt, cfg, shapes) if weights == "quantized" else {}
    blocks = load_kept(ckpt, cfg, shapes, kept, device) if kept else {}
    rest = {k: v for k, v in shapes.items() if k not in kept}
    # tensors the family keeps in float32 whatever the run dtype (as transformers does)
    keep = getattr(family_module(cfg), "FLOAT32_TENSORS", ()) if dtype != torch.float32 else ()
    f32 = {k: v for k, v in rest.items() if keep and k.endswith(keep)}
    tensors = read_tensors(ckpt, cfg, {k: v for k, v in rest.items() if k not in f32}, dtype,
                           device)
    if f32:
        tensors.update(read_tensors(ckpt, cfg, f32, torch.float32, device))
    with torch.device("meta"):
        model = LayerRange(cfg, start, end) if cfg.hybrid is None else HybridRange(cfg, start, end)
    state = {model.local_name(k): v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = set(missing) - {model.local_name(k) for k in kept}
    if missing or unexpected:  # a bug in the name tables, not bad input
        raise RuntimeError(f"internal name mismatch: missing={missing} unexpected={unexpected}")
    install_kept(model, blocks, kept, dtype)
    if cfg.hybrid is None:  # buffers are not in the state dict
        model.init_rope()
    else:
        model.inv_freq = model.rope_inv_freq()
    model.to(device).eval().requires_grad_(False)
    log.info(
        "loaded layers %d:%d of %s (%d tensors, %d kept quantized, %.1f s)",
        start, end, ckpt.path.name, len(shapes), len(kept), time.perf_counter() - t0,
    )
    return model

