"""Runs one layer range for one step: the compute half of a shard, with no IPC in it.

The reference engine runs the whole model through one executor; a shard process runs its
range through one, so both take exactly the same arithmetic path.
"""

from __future__ import annotations

import torch

from shards.graphs import StaticDecoder
from shards.kv_cache import KVCache, KVLayout
from shards.model import LayerRange
from shards.sampling import sample_rows


class RangeExecutor:
    def __init__(
        self, model: LayerRange, max_len: int, slots: int = 1, device: torch.device | str = "cpu",
        static_decode: bool | None = None, graph_bucket: int = 256,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        cfg = model.cfg
        self.dtype = next(model.parameters()).dtype
        self.layout = KVLayout(model.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.kv = KVCache(self.layout, max_len, slots, self.device)
        if static_decode is None:  # CUDA graphs on GPUs; the plain eager path on CPU
            static_decode = self.device.type == "cuda"
        self.static = StaticDecoder(model, self.kv, graph_bucket) if static_decode else None

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @torch.inference_mode()
    def run(
        self,
        x: torch.Tensor,
        pos: int,
        slot: int = 0,
        all_logits: bool = False,
        taps: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states (n, hidden) out of this range, or logits on the last range
        (of the last row, or of every row with `all_logits`)."""
        n = x.shape[0]
        if pos + n > self.kv.max_len:
            raise ValueError(
                f"positions {pos}..{pos + n} exceed the context of {self.kv.max_len} tokens"
            )
        if n == 1 and self.static is not None and taps is None:
            return self.static.run(x, pos, slot)
        rows = None if all_logits else slice(n - 1, n)
        return self.model(x.to(self.device), pos, self.kv, slot, logit_rows=rows, taps=taps)

    def sample(self, logits: torch.Tensor, sample: dict, position: int) -> int:
        """Sample the token for `position` from one row of logits."""
        return sample_rows(
            logits[-1:], sample["temperature"], sample["top_k"], sample["top_p"],
            sample["seed"], [position],
        )[0]
