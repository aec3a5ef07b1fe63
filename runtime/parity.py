"""How close two sets of next-token logits are: the measures of `layersplit check`.

Pure functions over float32 arrays of shape (positions, vocab). The reference's rows come first:
KL(reference ‖ ours) is how much probability the reference puts where we put less.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(slots=True)
class Agreement:
    """Position-by-position agreement of our logits with the reference's, summed over prompts
    (`add`); the means are over every compared position."""

    positions: int = 0
    top1_equal: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    logit_diff_max: float = 0.0
    nonfinite: int = 0  # positions where our logits held a NaN or an infinity

    def add(self, ref: np.ndarray, ours: np.ndarray) -> None:
        if ref.shape != ours.shape:
            raise ValueError(f"logits of shape {ours.shape} against the reference's {ref.shape}")
        if not len(ref):
            return
        bad = ~np.isfinite(ours).all(axis=-1)
        self.nonfinite += int(bad.sum())
        ref64, ours64 = ref.astype(np.float64), np.where(np.isfinite(ours), ours, 0.0)
        kl = kl_divergence(ref64, ours64.astype(np.float64))
        kl[bad] = np.inf
        self.positions += len(ref)
        self.top1_equal += int(((ref.argmax(-1) == ours.argmax(-1)) & ~bad).sum())
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        diff = np.abs(ref64 - ours64).max(axis=-1)
        diff[bad] = np.inf
        self.logit_diff_max = max(self.logit_diff_max, float(diff.max()))

    def add_failed(self, positions: int) -> None:
        """Positions whose logits never came (the request failed on non-finite logits)."""
        self.positions += positions
        self.nonfinite += positions
        self.kl_sum = self.kl_max = self.logit_diff_max = float("inf")

    @property
    def top1(self) -> float:
        return self.top1_equal / self.positions if self.positions else 1.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0

    def to_json(self) -> dict:
        return {"positions": self.positions, "top1_agreement": round(self.top1, 6),
                "mean_kl": _num(self.mean_kl), "max_kl": _num(self.kl_max),
                "max_abs_logit_diff": _num(self.logit_diff_max),
                "nonfinite_positions": self.nonfinite}


def _num(x: float) -> float | str:
    return x if np.isfinite(x) else "inf"  # (JSON has no infinity)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) ‖ softmax(ours)) of each row, in nats (float64)."""
    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(ours.astype(np.float64))
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    """What `check` passes: top-1 agreement at least `min_top1` and mean KL at most `max_kl`
    over the teacher-forced positions, and no non-finite logits anywhere."""

    min_top1: float
    max_kl: float

    @classmethod
    def for_dtype(cls, dtype: str) -> Thresholds:
        """float32 against float32 differs only by rounding (a changed weight shows at once);
        a half type's rounding moves near-ties: the floors every family must meet there."""
        if dtype == "float32":
            return cls(min_top1=0.999, max_kl=1e-6)
        return cls(min_top1=0.99, max_kl=1e-3)

    def failures(self, a: Agreement, what: str) -> list[str]:
        out = []
        if a.nonfinite:
            out.append(f"{what}: {a.nonfinite} positions with non-finite logits")
        if a.top1 < self.min_top1:
            out.append(f"{what}: top-1 agreement {a.top1:.4f} < {self.min_top1}")
        if a.mean_kl > self.max_kl:
            out.append(f"{what}: mean KL {a.mean_kl:.3g} > {self.max_kl:g}")
        return out
