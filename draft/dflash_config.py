"""A DFlash draft's config.json, read and checked without torch: the coordinator reads a
draft's tapped target layers (`runtime.speculative.draft_taps`) before any shard starts, and
importing torch for it cost ~1.4 s of every start on a GPU host. `draft.dflash` holds the
network itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from layersplit.draft.tree_shape import Shape, read_shape
from layersplit.shards.checkpoint import RANDOM_PREFIX
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig, config_from_hf
from layersplit.shards.random_weights import PRESETS_DIR

ARCHITECTURE = "DFlashDraftModel"


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps when a config names none: spread over layers 1 .. L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    model: ModelConfig  # the draft layers' shapes (Qwen3: q/k norms)
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None
    embedding_scale: float = 1.0
    spec_tree: Shape | None = None  # the token tree it proposes (`draft.tree_shape`); None: a chain
    # per draft layer (empty: every layer as the first): its sliding window (a block row at
    # position q sees keys k > q - window; None: all), and whether a block row sees only the
    # block rows up to its own (causal) or all of them
    windows: tuple[int | None, ...] = ()
    causal: tuple[bool, ...] = ()

    def attention(self, layer: int) -> tuple[int | None, bool]:
        """(window, causal) of draft layer `layer`."""
        if not self.windows:
            return None, False
        return self.windows[layer], self.causal[layer]

    @property
    def width(self) -> int:
        """Features per context row: the tapped layers' rows side by side."""
        return len(self.target_layer_ids) * self.model.hidden_size

    def check_target(self, target: ModelConfig, source: str | Path) -> None:
        """A draft trained for another target is refused with the field that differs."""
        m = self.model
        if m.hidden_size != target.hidden_size:
            raise CheckpointError(f"{source}: draft hidden_size {m.hidden_size} != the target's "
                                  f"{target.hidden_size}")
        if m.vocab_size != target.vocab_size:
            raise CheckpointError(f"{source}: draft vocab_size {m.vocab_size} != the target's "
                                  f"{target.vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise CheckpointError(f"{source}: draft was trained for a target of "
                                  f"{self.num_target_layers} layers; this one has "
                                  f"{target.num_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise CheckpointError(f"{source}: target_layer_ids {list(self.target_layer_ids)} "
                                  f"name layer {bad[0]}, outside the target's "
                                  f"0..{target.num_layers - 1}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise CheckpointError(f"{source}: mask_token_id {self.mask_token_id} is outside the "
                                  f"vocabulary 0..{target.vocab_size - 1}")


def dflash_folder(spec: str | Path) -> Path | None:
    """The folder of a DFlash draft's config: `spec` itself, or for `random:NAME` (seeded
    random weights, `shards.random_weights`) the preset's folder; None when it is no DFlash
    draft (a classic one)."""
    text = str(spec)
    if text.startswith(RANDOM_PREFIX):
        name = text[len(RANDOM_PREFIX):]
        folder = Path(name) if "/" in name else PRESETS_DIR / name
    else:
        folder = Path(spec)
    return folder if folder.is_dir() and is_dflash(folder) else None


def is_dflash(folder: Path) -> bool:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (ARCHITECTURE in (raw.get("architectures") or ())
                                      or "dflash_config" in raw)


def read_dflash_config(folder: Path) -> DFlashConfig:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    return read_dflash_config_dict(raw, path)


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def refuse_unimplemented(raw: dict, sub: dict, path: Path) -> None:
    """The published DFlash fields whose effect is not implemented here, refused by name
    (z-lab's reference reads each from `dflash_config` or the top level)."""
    def value(name: str) -> Any:
        return sub.get(name, raw.get(name))

    arch = raw.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in arch:
        raise CheckpointError(f"{path}: architectures {arch}: only {ARCHITECTURE} is "
                              "implemented (not DFlash2's convolutions and candidate selector)")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise CheckpointError(f"{path}: model_type {raw['model_type']!r}: DFlash draft layers "
                              "are Qwen3 layers (model_type 'qwen3')")
    for name in DFLASH2_FIELDS:
        if value(name) is not None:
            raise CheckpointError(f"{path}: {name}={value(name)!r} (DFlash2) is not implemented")
    if value("output_multiplier") not in (None, 1, 1.0):
        raise CheckpointError(f"{path}: output_multiplier={value('output_multiplier')!r} is "
                              "not implemented")
    if value("final_logit_softcapping") not in (None, 0, 0.0):
        raise CheckpointError(f"{path}: final_logit_softcapping="
                              f"{value('final_logit_softcapping')!r} is not implemented")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act={raw['hidden_act']!r} is not supported "
                              "(only 'silu')")


def read_dflash_config_dict(raw: Any, path: Path) -> DFlashConfig:
    """Parse a DFlash config; every error names the field and the file."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    sub: dict[str, Any] = raw.get("dflash_config") or {}
    if not isinstance(sub, dict):
        raise CheckpointError(f"{path}: dflash_config must be an object")

    def field(name: str, default: Any = None) -> Any:
        return sub.get(name, raw.get(name, default))

    refuse_unimplemented(raw, sub, path)
    windows, causal = _layer_attention(raw, sub, path)
    # (the windows are the draft's own, `DFlashConfig.attention`: not its decoder layers')
    model = config_from_hf({k: v for k, v in raw.items() if k not in WINDOW_FIELDS}
                           | {"model_type": "qwen3"}, path, strict=False)
    block = field("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise CheckpointError(f"{path}: block_size must be an integer >= 2, got {block!r}")
    mask = field("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise CheckpointError(f"{path}: mask_token_id must be an integer, got {mask!r}")
    n_target = raw.get("num_target_layers")
    taps = field("target_layer_ids")
    if taps is None:
        if n_target is None:
            raise CheckpointError(f"{path}: needs target_layer_ids or num_target_layers")
        taps = default_target_layers(int(n_target), model.num_layers)
    if not isinstance(taps, list) or not taps or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise CheckpointError(f"{path}: target_layer_ids must be a non-empty list of integers")
    if sorted(set(taps)) != taps:
        raise CheckpointError(f"{path}: target_layer_ids must be increasing, got {taps}")
    return DFlashConfig(model, block, tuple(taps), mask,
                        None if n_target is None else int(n_target),
                        float(field("input_embedding_scale", 1.0)),
                        read_shape(raw.get("spec_tree"), block, path), windows, causal)


WINDOW_FIELDS = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")


def _layer_attention(raw: dict, sub: dict, path: Path
                     ) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """Each draft layer's (window, causal), as z-lab's reference reads them: a
    `sliding_attention` entry of `layer_types` attends the last `sliding_window` positions and,
    unless `is_causal` (or `dflash_config.causal`) says otherwise, its block rows causally; a
    `full_attention` one everything, its block rows each other (or causally with `is_causal`).
    ((), ()) when every layer is a plain full one."""
    n = raw.get("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        types = ["full_attention"] * (n if isinstance(n, int) else 0)
    if not isinstance(types, list) or len(types) != n or any(
            t not in ("full_attention", "sliding_attention") for t in types):
        raise CheckpointError(f"{path}: layer_types {types!r} must list full_attention or "
                              f"sliding_attention for each of the {n} layers")
    window = raw.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool)
                                         or window < 1):
        raise CheckpointError(f"{path}: sliding_window={window!r}: sliding_attention layers "
                              "need a positive window")
    override = raw.get("is_causal", sub.get("is_causal", sub.get("causal", raw.get("causal"))))
    if override is not None and not isinstance(override, bool):
        raise CheckpointError(f"{path}: is_causal/causal must be true or false, got "
                              f"{override!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    causal = tuple(t == "sliding_attention" if override is None else override for t in types)
    if not any(causal) and all(w is None for w in windows):
        return (), ()
    return windows, causal
