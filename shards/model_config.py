"""The architecture facts a layer range needs, read from an HF `config.json` or a GGUF header."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shards.errors import CheckpointError

# model_type -> (q/k/v bias, q/k RMSNorm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )

    @property
    def rope_type(self) -> str:
        d = dict(self.rope_scaling)
        return str(d.get("rope_type", d.get("type", "default")))

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = [list(kv) for kv in self.rope_scaling]
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = tuple((str(k), v) for k, v in d.get("rope_scaling", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def kv_bytes_per_token(self, layers: int, itemsize: int) -> int:
        return 2 * layers * self.num_kv_heads * self.head_dim * itemsize


def _eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(raw: dict[str, Any], source: str | Path) -> ModelConfig:
    """Build a ModelConfig from the dict of an HF `config.json`; errors name the field and file."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{source}: model_type={model_type!r} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    bias_default, qk_norm = FAMILIES[model_type]

    def need(key: str) -> Any:
        if key not in raw:
            raise CheckpointError(f"{source}: required field {key!r} is missing")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    rope = raw.get("rope_scaling") or {}
    if "rope_parameters" in raw and isinstance(raw["rope_parameters"], dict):
        rope = {**raw["rope_parameters"], **rope}
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", bias_default)),
        qk_norm=qk_norm,
        rope_scaling=tuple(sorted((str(k), v) for k, v in rope.items())),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_list(raw.get("eos_token_id")),
    )


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config_from_hf(raw, path)
