"""A request's sampling parameters, and the wire form of the logits processors the coordinator
sends with a step (`pack_bias`, `pack_mask`; the shards read them in `shards.sampling`). No
torch here: the coordinator imports this and never loads torch itself."""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)

    def wire(self) -> dict:
        """The fields a sampling shard needs, as a plain dict for the control protocol."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed or 0}


def is_greedy(temperature: float, top_k: int) -> bool:
    """Sampling that always draws the argmax."""
    return temperature == 0 or top_k == 1


def new_seed() -> int:
    """A request's seed when it asks for none."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def pack_bias(ids: Sequence[int], values: Sequence[float]) -> bytes:
    """The sample's `bias`: int32 ids, then their float32 values."""
    return (np.array(list(ids), dtype=np.int32).tobytes()
            + np.array(list(values), dtype=np.float32).tobytes())


def pack_mask(allowed: Any) -> bytes:
    """The inverse of `shards.sampling.mask_bits`: (vocab,) bool (a numpy array, or a tensor,
    copied to the host) -> zlib of a little-endian bitmask."""
    if hasattr(allowed, "cpu"):  # (a torch tensor, maybe on a GPU)
        allowed = allowed.cpu().numpy()
    bits = np.asarray(allowed).astype(bool)
    return zlib.compress(np.packbits(bits, bitorder="little").tobytes(), 1)
