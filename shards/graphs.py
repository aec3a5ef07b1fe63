"""Decode steps through CUDA graphs: one graph per KV-length bucket, captured on first use.

A decode step (one token) of a layer range is a few hundred small kernels; launched one by one
from Python they cost more than the math. Captured once and replayed, they cost one launch. The
graph reads its token (or hidden row) and position from static device buffers, writes its KV row
with `index_copy_` and attends a fixed number of keys (the bucket) under a mask, so one graph
serves every position of its bucket (`StepInfo.static`).

`StaticDecoder` is the seam: on CPU it runs the same static step without capture, which the
tests compare with the eager path; on CUDA it captures and replays.
"""

from __future__ import annotations

import logging

import torch

from shards.kv_cache import KVCache
from shards.model import LayerRange, StepInfo

log = logging.getLogger(__name__)


class StaticDecoder:
    def __init__(self, model: LayerRange, kv: KVCache, bucket: int = 256) -> None:
        self.model, self.kv, self.bucket = model, kv, bucket
        dev = kv.k.device
        self.capture = dev.type == "cuda"
        dtype = kv.k.dtype
        if model.is_first:
            self.x = torch.zeros(1, dtype=torch.long, device=dev)
        else:
            self.x = torch.zeros(1, model.cfg.hidden_size, dtype=dtype, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def kv_len(self, pos: int) -> int:
        return min(-(-(pos + 1) // self.bucket) * self.bucket, self.kv.max_len)

    def _step(self, slot: int, kv_len: int) -> torch.Tensor:
        step = StepInfo.static(self.pos, 1, kv_len)
        return self.model(self.x, step, self.kv, slot, logit_rows=slice(0, 1))

    @torch.inference_mode()
    def run(self, x: torch.Tensor, pos: int, slot: int = 0) -> torch.Tensor:
        self.x.copy_(x.reshape(self.x.shape))
        self.pos.fill_(pos)
        kv_len = self.kv_len(pos)
        if not self.capture:
            return self._step(slot, kv_len)
        key = (slot, kv_len)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(slot, kv_len)
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, slot: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs write the real row of the real position: replay writes the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(slot, kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(slot, kv_len)
        log.debug("captured a decode graph for layers %d:%d, %d keys", self.model.start,
                  self.model.end, kv_len)
        return graph, out
