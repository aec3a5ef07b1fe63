"""Hugging Face model folders: config.json plus single or sharded *.safetensors.

Only the tensors a layer range needs are read (safetensors files are memory-mapped).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig, read_hf_config
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


class HFCheckpoint:
    """A Hugging Face folder. `load` reads canonical tensor names, one file at a time."""

    def __init__(self, folder: Path, strict: bool = True, config: ModelConfig | None = None
                 ) -> None:
        """`strict`: see `config_from_hf` (False for a draft's folder only); `config`: the
        shape, read elsewhere (a DFlash draft's layers, `draft.dflash`)."""
        self.path = folder
        self.config: ModelConfig = config or read_hf_config(folder, strict)
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from e
            return {str(k): str(v) for k, v in wm.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        wm: dict[str, str] = {}
        for f in files:
            with _open(f) as st:
                for k in st.keys():
                    wm[k] = f.name
        return wm

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def load(
        self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Read each canonical name from its source tensor, checking shape; one pass per file."""
        by_file: dict[str, list[str]] = {}
        for name, src in sources.items():
            if src not in self.weight_map:
                raise CheckpointError(
                    f"{self.path}: tensor {src!r} is missing (needed for {name!r})"
                )
            by_file.setdefault(self.weight_map[src], []).append(name)
        out: dict[str, torch.Tensor] = {}
        cache: dict[str, torch.Tensor] = {}
        for fname, names in by_file.items():
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: listed in the index but missing")
            with _open(fpath) as st:
                for name in names:
                    src = sources[name]
                    if src not in cache:
                        try:
                            t = st.get_tensor(src)
                        except Exception as e:
                            raise CheckpointError(
                                f"{fpath}: cannot read tensor {src!r}: {e}") from e
                        if tuple(t.shape) != shapes[name]:
                            raise CheckpointError(
                                f"{fpath}: tensor {src!r} has shape {tuple(t.shape)}, "
                                f"expected {shapes[name]} from config.json"
                            )
                        cache[src] = t.to(device=device, dtype=dtype)
                    out[name] = cache[src]
        return out
