"""Decode and verify steps through CUDA graphs: one graph per (KV-length bucket, rows), captured
on first use.

A decode step (one token) of a layer range is a few hundred small kernels; launched one by one
from Python they cost more than the math. Captured once and replayed, they cost one launch. The
graph reads its tokens (or hidden rows) and first position from static device buffers, writes
its KV rows with `index_copy_` and attends a fixed number of keys (the bucket) under a mask, so
one graph serves every position of its bucket (`StepInfo.static`). A speculative verify step is
the same with a few rows (the last token and the draft tokens); the rows of tapped layers (fed
to a feature-conditioned draft) are outputs of the graph.

`StaticDecoder` is the seam: on CPU it runs the same static step without capture, which the
tests compare with the eager path; on CUDA it captures and replays.
"""

from __future__ import annotations

import logging

import torch

from shards.kv_cache import KVCache
from shards.model import LayerRange, StepInfo

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, dict[int, torch.Tensor]]


def capture(fn, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture `fn()` in a CUDA graph after two warm-up runs on a side stream; returns the graph
    and what `fn` returned (static tensors that each replay overwrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class StaticDecoder:
    def __init__(self, model: LayerRange, kv: KVCache, bucket: int = 256,
                 taps: tuple[int, ...] = ()) -> None:
        self.model, self.kv, self.bucket = model, kv, bucket
        self.taps = tuple(t for t in taps if model.start <= t < model.end)
        dev = kv.k.device
        self.capture = dev.type == "cuda"
        self.inputs: dict[int, torch.Tensor] = {}  # rows -> static input buffer
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def kv_len(self, pos: int, n: int = 1) -> int:
        return min(-(-(pos + n) // self.bucket) * self.bucket, self.kv.max_len)

    def _input(self, n: int) -> torch.Tensor:
        x = self.inputs.get(n)
        if x is None:
            dev = self.kv.k.device
            if self.model.is_first:
                x = torch.zeros(n, dtype=torch.long, device=dev)
            else:
                x = torch.zeros(n, self.model.cfg.hidden_size, dtype=self.kv.k.dtype, device=dev)
            self.inputs[n] = x
        return x

    def _step(self, slot: int, kv_len: int, n: int) -> Outputs:
        step = StepInfo.static(self.pos, n, kv_len)
        taps: dict[int, torch.Tensor] = dict.fromkeys(self.taps)
        out = self.model(self._input(n), step, self.kv, slot, logit_rows=slice(0, n), taps=taps)
        return out, taps

    @torch.inference_mode()
    def run(self, x: torch.Tensor, pos: int, slot: int = 0) -> Outputs:
        """Hidden rows (or logits of every row, on the last range) of a step of len(x) rows at
        positions [pos, pos + len(x)), and the rows of this range's tapped layers."""
        n = x.shape[0]
        self._input(n).copy_(x.reshape(self._input(n).shape))
        self.pos.fill_(pos)
        kv_len = self.kv_len(pos, n)
        if not self.capture:
            return self._step(slot, kv_len, n)
        key = (slot, kv_len, n)
        entry = self.graphs.get(key)
        if entry is None:
            entry = capture(lambda: self._step(slot, kv_len, n), self.pool)
            log.debug("captured a %d-row step graph for layers %d:%d, %d keys", n,
                      self.model.start, self.model.end, kv_len)
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out
