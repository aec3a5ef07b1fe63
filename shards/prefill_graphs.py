"""Eager prefill steps of a small dense range through piecewise CUDA graphs.

An eager step's dense layer on a GPU is about a dozen launches around flash attention
(`FusedDecode.prefill`): the input norm, q/k/v, the rotary (which stores the K/V rows),
o_proj, add + norm, gate/up, SiLU * up, down, add + the next norm. On a small model each
launch costs the host more than the GPU's work: on an H200 the default model's shape spent
~520 us of host a layer of a 500-row step against ~75 us of GPU (`bench/prefill_host.py`,
2026-12-02), so a prefill chunk, a kept answer and a cached turn's new message all waited on
Python. Here the launches between one layer's attention and the next are one CUDA graph (a
"piece"), captured once per row bucket (every bucket before serve says ready: `warm`,
the shard's `warm_prefill`; elsewhere a bucket on its first step): piece 0 is
the first layer's norm, q/k/v and rotary; piece i + 1 is layer i's o_proj to its MLP and the
next layer's norm, q/k/v and rotary. The
attention stays eager between the replays (its keys are any prefix: the graphs do not depend
on the position), reading the step's q/k/v rows from static buffers and writing its output to
one.

A step of n rows runs in the smallest bucket of at least n rows: the padding rows start from
zero each step (a pass from zero: finite, whatever ran before), no real row reads them (every
launch in a piece is row by row, and attention takes the first n rows only), and they store
their K/V rows in the pool's scratch row, which masked reads elsewhere may touch. The kernels
are the eager path's, in the same order: a row's values differ from it only where a GEMM of
the bucket's rows rounds otherwise than one of n rows (as `RangeExecutor._prefill_batched`'s
do). On a CPU (tests) the pieces run as plain calls, no capture.

Only a range of Llama-like dense layers on the row kernels, full attention, no sinks, a paged
pool in the run's dtype, a hidden size up to `MAX_HIDDEN`: a large model's prefill is the
GPU's work, not the host's, and its buckets' buffers would be large. `LAYERSPLIT_PREFILL_GRAPHS
=0` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from layersplit.shards.fused import FusedDecode, dense_after_attention, linear, rope_qk_rows
from layersplit.shards.layers.attention import attend
from layersplit.shards.layers.rotary import rope_cos_sin
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.models import LayerRange
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.switches import switched_off

log = logging.getLogger(__name__)

SWITCH = "LAYERSPLIT_PREFILL_GRAPHS"
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # rows a step is padded to
MAX_HIDDEN = 1024  # the widest range they serve (measured on the default model's 576)


def refusal(model: LayerRange, kv: object) -> str | None:
    """Why the range's eager steps cannot run as pieces, or None."""
    if switched_off(SWITCH):
        return f"{SWITCH}=0"
    if model.cfg.hidden_size > MAX_HIDDEN:
        return f"hidden size {model.cfg.hidden_size} > {MAX_HIDDEN}"
    if not isinstance(kv, PagedKVCache):
        return "no paged KV pool"
    if model.local_inv_freq is not None:
        return "local rotary layers"
    if kv.k_store.dtype != next(model.parameters()).dtype:
        return f"a KV pool of {kv.k_store.dtype}"
    for i, layer in enumerate(model.layers):
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(getattr(layer, "fast", None), FusedDecode) or \
                hasattr(m, "experts") or getattr(a, "qkv_proj", None) is None or \
                getattr(m, "gate_up_proj", None) is None or \
                model.cfg.window(model.start + i) is not None or \
                getattr(a, "sinks", None) is not None or getattr(layer, "kept_quantized", False):
            return f"layer {model.start + i} is not a dense Llama-like layer on the row kernels"
    return None


@dataclasses.dataclass
class _Bucket:
    """The static buffers of one row bucket and its pieces (graphs on CUDA, else calls)."""

    h: torch.Tensor  # (R, hidden) the residual stream, in and out of every piece
    attn: torch.Tensor  # (R, heads * D) an attention's output, into the next piece
    cos: torch.Tensor  # (R, D)
    sin: torch.Tensor
    rows: torch.Tensor  # (R,) long: the pool row each row's K/V go to (padding: scratch)
    q: torch.Tensor  # (R, heads, D) the next attention's queries, keys and values
    k: torch.Tensor
    v: torch.Tensor
    pieces: list[Callable[[], None]] = dataclasses.field(default_factory=list)


class PrefillGraphs:
    def __init__(self, model: LayerRange, kv: PagedKVCache, max_rows: int) -> None:
        self.model, self.kv = model, kv
        self.device = kv.k_store.device
        self.dtype = kv.k_store.dtype
        self.buckets = [b for b in BUCKETS if b <= max_rows]
        self.sets: dict[int, _Bucket] = {}
        self.capture = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.on = True  # off after a failure (logged): the eager layers run
        self.scratch = kv.num_blocks * kv.block  # the scratch block's first pool row
        a = model.layers[0].self_attn
        self.nh, self.ng, self.d = a.num_heads, a.num_kv_heads, a.head_dim

    def takes(self, n: int) -> bool:
        """Whether an eager step of `n` rows runs as pieces: one bucket holds it, and the row
        kernels are on in every layer (a failed one turns its layer's off)."""
        return self.on and bool(self.buckets) and n <= self.buckets[-1] and all(
            layer.fast.prefill_kernels and layer.fast.kernels is not False
            for layer in self.model.layers)

    @torch.inference_mode()
    def run(self, h: torch.Tensor, pos: int, slot: int,
            taps: dict[int, torch.Tensor] | None) -> torch.Tensor | None:
        """The range's output rows (n, hidden) for the eager step of hidden rows `h` (n, hidden,
        embedded) at [pos, pos + n) of `slot`; None where the pieces failed (logged, off from
        then on; nothing of the step ran past its buffers, and the caller's eager layers
        rewrite the same K/V rows)."""
        n = h.shape[0]
        step = StepInfo.eager(pos, n, self.device)
        _, _, write = self.kv.step_pool(0, slot, step)  # (raises if the table is too short)
        r = next(b for b in self.buckets if b >= n)
        try:
            b = self.sets.get(r) or self._build(r)
        except Exception as e:  # noqa: BLE001 - the eager layers run instead
            self._fail(r, e)
            return None
        cos, sin = rope_cos_sin(self.model.inv_freq, step.positions, h.dtype,
                                self.model.rope_scale)
        b.rows.fill_(self.scratch)
        b.rows[:n].copy_(write)
        b.cos[:n].copy_(cos)
        b.sin[:n].copy_(sin)
        b.h[:n].copy_(h)
        b.h[n:].zero_()  # (padding rows start from zero each step: a pass from zero, bounded,
        b.attn[n:].zero_()  # not the last step's outputs run through the range again)
        b.pieces[0]()
        last = self.model.cfg.num_layers - 1
        for i, layer in enumerate(self.model.layers):  # (full attention: the step's own mask)
            keys, values = self.kv.gather(i, slot, step, b.k[:n], b.v[:n])
            b.attn[:n].copy_(attend(b.q[:n], keys, values, step.mask, step.causal,
                                    layer.self_attn.sdpa_scale))
            b.pieces[i + 1]()
            g = self.model.start + i
            if taps is not None and g in taps:  # (HF's hidden_states[g + 1]: the last normed)
                taps[g] = self.model.norm(b.h[:n]) if g == last else b.h[:n].clone()
        return b.h[:n].clone()

    @torch.inference_mode()
    def warm(self, max_rows: int) -> tuple[int, float]:
        """Build every bucket a step of up to `max_rows` rows runs in, before any request (a
        shard's `warm_prefill`: `shards.worker_setup`); (buckets built, seconds). A failure
        turns the pieces off (logged): the eager layers run."""
        t0, built = time.perf_counter(), 0
        if not self.takes(1):  # (the row kernels turned off: no step would replay them)
            return 0, 0.0
        for r in self.buckets:
            if r not in self.sets:
                try:
                    self._build(r)
                except Exception as e:  # noqa: BLE001 - the eager layers run instead
                    self._fail(r, e)
                    break
                built += 1
            if r >= max_rows:
                break
        return built, time.perf_counter() - t0

    def _fail(self, r: int, e: BaseException) -> None:
        log.warning("layers %d:%d: prefill graphs of %d rows failed (%s: %s); eager prefill "
                    "steps run layer by layer from now on", self.model.start, self.model.end,
                    r, type(e).__name__, e)
        self.on = False
        self.sets.clear()  # (their graphs and buffers given back)

    def _build(self, r: int) -> _Bucket:
        """Bucket `r`'s buffers and pieces; on CUDA each piece captured (after warm-up runs,
        its K/V rows all to the scratch row)."""
        dev, dt, nh, ng, d = self.device, self.dtype, self.nh, self.ng, self.d
        hidden = self.model.cfg.hidden_size
        b = _Bucket(h=torch.zeros(r, hidden, device=dev, dtype=dt),
                    attn=torch.zeros(r, nh * d, device=dev, dtype=dt),
                    cos=torch.zeros(r, d, device=dev, dtype=dt),
                    sin=torch.zeros(r, d, device=dev, dtype=dt),
                    rows=torch.full((r,), self.scratch, device=dev, dtype=torch.long),
                    q=torch.zeros(r, nh, d, device=dev, dtype=dt),
                    k=torch.zeros(r, ng, d, device=dev, dtype=dt),
                    v=torch.zeros(r, ng, d, device=dev, dtype=dt))
        calls = [self._first(b)] + [self._after(b, i) for i in range(len(self.model.layers))]
        if not self.capture:
            b.pieces = calls
        else:
            from layersplit.shards.graphs import capture

            for fn in calls:
                graph, _ = capture(fn, self.pool)
                b.pieces.append(graph.replay)
            log.info("layers %d:%d: prefill graphs of %d rows captured (%d pieces)",
                     self.model.start, self.model.end, r, len(calls))
        self.sets[r] = b
        return b

    def _qkv_rope(self, b: _Bucket, i: int, x: torch.Tensor) -> None:
        """Layer i's q/k/v of its normed input `x`, rotated (the K/V rows stored in the pool
        by the rotary's kernel, as `FusedDecode._prefill`), into the bucket's buffers."""
        layer = self.model.layers[i]
        a = layer.self_attn
        qkv = linear(a.qkv_proj, x)
        q, k = rope_qk_rows(a, qkv, b.cos, b.sin, layer.input_layernorm.eps,
                            (self.kv.k_layers[i], self.kv.v_layers[i], b.rows))
        b.q.copy_(q)
        b.k.copy_(k)
        b.v.copy_(qkv[:, (self.nh + self.ng) * self.d:].view(-1, self.ng, self.d))

    def _first(self, b: _Bucket) -> Callable[[], None]:
        def piece() -> None:  # the first layer's input norm, q/k/v, rotary
            from layersplit.shards.kernels import row_ops

            ln = self.model.layers[0].input_layernorm
            self._qkv_rope(b, 0, row_ops.rms_norm_rows(b.h, ln.weight, ln.eps))
        return piece

    def _after(self, b: _Bucket, i: int) -> Callable[[], None]:
        def piece() -> None:  # layer i after attention (as `FusedDecode._dense_rest`), then
            # the next layer's q/k/v
            layers = self.model.layers
            layer = layers[i]
            ln = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            out, normed = dense_after_attention(layer, b.h, b.attn, layer.input_layernorm.eps,
                                                None if ln is None else (ln.weight, ln.eps))
            b.h.copy_(out)
            if normed is not None:
                self._qkv_rope(b, i + 1, normed)
        return piece
