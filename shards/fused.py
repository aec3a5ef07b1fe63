"""The GPU decode step of a layer with its elementwise work fused by torch.compile.

A decode step of one layer is ~60 kernels in eager PyTorch (each RMSNorm alone is eight); inside
a CUDA graph each still costs ~2 us, several ms per token for a 36-layer model. Here the work
before attention (norm, fused q/k/v matmul, q/k norm, rotary) and after it (o_proj, residual,
norm, fused gate/up matmul, SiLU, down, residual) are two functions compiled once and shared by
every layer (weights are arguments, so one compilation serves all layers of a shape). Attention
stays eager (its key count changes with the graph bucket). Same math as `shards.model`; the GPU
tests compare the two.

Batched decode steps (`StepInfo.batched`) run the same two functions on their padded rows, but
compiled under code objects of their own: dynamo allows 8 compiled shapes per code object (with
fullgraph a 9th raises), and each batch bucket is a shape, so sharing would starve the
single-sequence and verify steps.

With the Triton kernels (`shards.kernels`, on by default on CUDA; `LAYERSPLIT_FUSED_KERNELS=0`
switches them off) a layer is fewer kernels and nothing compiled: the q/k/v projection, one
decode-attention kernel that also applies the q/k norm and rotary and writes the KV rows
(`shards.kernels.decode_attention`), then o_proj, the residual add with the post-attention
norm in one kernel, gate/up, SiLU * up in one kernel, down, and the residual add with the next
layer's input norm (`shards.kernels.row_ops`), so the next layer starts at its projection.
torch.compile is made at a stage's first call, so a dense model on the kernels never imports it
(5-8 s of a start on an H100). A mixture-of-experts layer's work after attention is
`shards.fused_moe` (router and grouped-GEMM experts, compiled; no next-norm folding), but for
a one-row step (`FusedDecode._moe_row`, below).

A one-row step of one sequence (batch-1 decode, the bulk of a user's wait) goes further: its
projections are the GEMV kernels of `shards.kernels.gemv`, with the norms as their prologue and
the residual adds and SiLU * up as their epilogue: q/k/v, attention (two kernels), o_proj,
gate/up, down: 6 kernels a layer (a sparse layer: q/k/v, attention, o_proj, the router with
its norm as its prologue, the routing (in the router's launch with `FUSED_ROUTE_SWITCH`) and
the experts' three). The last range's final norm and LM head are one more
(`FusedDecode.head`, `RangeModel.head_fast`). `LAYERSPLIT_GEMV_KERNELS=0` switches them off.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F
from layersplit.shards.fused_moe import moe_args, post_attention_moe, post_attention_moe_batch
from layersplit.shards.kernels import (
    fused_kernels_available,
    gemv_kernels_available,
    gemv_max_rows,
    kernel_failed,
    switched_on,
    try_kernel,
)
from layersplit.shards.layers import routed_moe
from layersplit.shards.layers.attention import Attention, attend, group_queries
from layersplit.shards.layers.gemv_linear import linears_as_gemv
from layersplit.shards.layers.norm import RMSNorm, norms_as_row_kernels
from layersplit.shards.layers.quant_linear import (
    KEPT_LINEARS,
    QuantLinear,
    gemv_takes,
    is_quantized,
    module_gemv,
)
from layersplit.shards.lazy_compile import compiled_on_first_call
from layersplit.shards.paged_kv import PagedKVCache

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def pre_attention(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps: float, nh: int, ng: int,
                  hd: int, grouped: bool = False):
    """q, k, v of a step; with `grouped`, q grouped per KV head (`group_queries`) for
    `Attention._grouped`."""
    x = rms_norm(h, ln_w, eps)
    q, k, v = F.linear(x, qkv_w, qkv_b).split([nh * hd, ng * hd, ng * hd], dim=-1)
    n = h.shape[0]
    q, k, v = q.reshape(n, nh, hd), k.reshape(n, ng, hd), v.reshape(n, ng, hd)
    if qn_w is not None:
        q, k = rms_norm(q, qn_w, eps), rms_norm(k, kn_w, eps)
    q = rope(q, cos, sin)
    return group_queries(q, ng) if grouped else q, rope(k, cos, sin), v.contiguous()


def post_attention(h, attn, o_w, ln2_w, gu_w, down_w, eps: float):
    h = h + F.linear(attn, o_w)
    g, u = F.linear(rms_norm(h, ln2_w, eps), gu_w).chunk(2, dim=-1)
    return h + F.linear(F.silu(g) * u, down_w)


def norm_qkv(h, ln_w, qkv_w, qkv_b, eps: float):
    """The q/k/v projection of a layer's normalized input, in torch (`bench/attention_kernel.py`;
    the kernels' path runs `row_ops.rms_norm_rows` and the projection)."""
    return F.linear(rms_norm(h, ln_w, eps), qkv_w, qkv_b)


def pre_attention_batch(*args):
    """`pre_attention` under its own code object, for batched steps (see the module doc)."""
    return pre_attention(*args)


def post_attention_batch(*args):
    """`post_attention` under its own code object, for batched steps (see the module doc)."""
    return post_attention(*args)


class _Stages:
    """The functions before and after attention for one kind of step, compiled or eager:
    `pre`/`post` around the torch attention, `post_moe` after a sparse layer's attention
    (torch's or the kernel's)."""

    NAMES = ("pre", "post", "post_moe")

    def __init__(self, pre, post, compile: bool, post_moe=post_attention_moe) -> None:
        self.eager = dict(zip(self.NAMES, (pre, post, post_moe)))
        self.compiled = compile
        for name, f in self.eager.items():
            setattr(self, name, compiled_on_first_call(f) if compile else f)

    def uncompile(self) -> None:
        for name, f in self.eager.items():
            setattr(self, name, f)
        self.compiled = False


# the least rows x hidden of an eager step that runs through the row kernels (`FusedDecode.
# prefill`); 0: every one. On an H200 they paid at every chunk size measured, on both the
# default model's shape and the Llama-8B shape (bench/profile_prefill.py --prefill-kernels
# off,on: chunks of 256 to 2048 rows, 1.2-1.6 x): a Triton launch costs the host ~40 us, as
# much as torch's RMSNorm module or rotary alone
PREFILL_KERNELS_MIN_ELEMENTS = 0


def prefill_kernels_take(rows: int, width: int) -> bool:
    """Whether an eager step of `rows` x `width` activations is large enough for the row
    kernels (`PREFILL_KERNELS_MIN_ELEMENTS`)."""
    return rows * width >= PREFILL_KERNELS_MIN_ELEMENTS


# 1: a sparse layer's one-row step routes in its router's GEMV launch (`gemv.gemv_route`: the
# last program to finish routes the row), one launch fewer a layer; off: measured no faster (the
# Qwen3-30B-A3B shape's batch 1 359.5 against 361.0 tok/s, DeepSeek-V2-Lite's 465.0 against 465.0;
# H200, 2026-12-01). Each
# layer's counter serves one launch at a time: a range's steps run on one stream
FUSED_ROUTE_SWITCH = "LAYERSPLIT_MOE_FUSED_ROUTE"
FUSED_ROUTE = "MoE fused routing"  # (`try_kernel`'s name)
HEAD_GEMV_ROWS = 32  # rows up to which the LM head takes the GEMV kernels (measured to 32)
HEAD_GEMV_MAX_K = 1024  # ... for a hidden size up to this (measured: 576)


# the most rows of a step whose projections kept quantized take the GEMV (`kernels.
# quant_gemv.MAX_ROWS`, as FP8's and int4's; more: the layer's own modules)
QUANT_GEMV_ROWS = 16


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` as the very `F.linear` call its forward makes, without
    the module call's host work (hooks, dispatch: ~1.5 us, four times a layer of an eager
    step). Anything else (a projection kept quantized) through its own forward."""
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def rope_qk_rows(a, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `a`'s rotated queries and keys of its q/k/v rows `qkv` through the rotary
    kernel (`row_ops.rope_qk`): its q/k norms where it has them (their eps, else the layer's
    `eps`); `pool`: where the kernel also stores the K/V rows (`PagedKVCache.step_pool`)."""
    from layersplit.shards.kernels import row_ops

    return row_ops.rope_qk(qkv, cos, sin, a.num_heads, a.num_kv_heads,
                           None if a.q_norm is None else a.q_norm.weight,
                           None if a.k_norm is None else a.k_norm.weight,
                           eps if a.q_norm is None else a.q_norm.eps, pool)


def dense_after_attention(layer, h: torch.Tensor, attn: torch.Tensor, eps: float,
                          nxt: tuple[torch.Tensor, float] | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense layer after attention through the row kernels, nothing compiled: o_proj,
    add + norm, gate/up, SiLU * up, down, add + the next layer's input norm `nxt` (weight,
    eps); (the layer's output, that norm of it, None without `nxt`)."""
    from layersplit.shards.kernels import row_ops

    a, m = layer.self_attn, layer.mlp
    h, x = row_ops.add_rms_norm(h, linear(a.o_proj, attn),
                                layer.post_attention_layernorm.weight, eps)
    act = row_ops.silu_mul(linear(m.gate_up_proj, x))
    nxt_w, nxt_eps = nxt if nxt is not None else (None, 0.0)
    return row_ops.add_rms_norm(h, linear(m.down_proj, act), nxt_w, nxt_eps)


def _kept(layer) -> bool:
    """Whether a layer holds weights kept quantized (`fuse_projections` marks it)."""
    return getattr(layer, "kept_quantized", False)


def _weight(module):
    """What `_gemv` takes for a projection: an `nn.Linear`'s weight, or a module kept
    quantized itself (`quant_linear.module_gemv`)."""
    return module.weight if type(module) is torch.nn.Linear else module


class GemvError(RuntimeError):
    """A GEMV kernel (`kernels.gemv`) failed on `rows` rows: what turns them, and only them,
    off (the few-rows kernel's failure only the few-rows kernel: `gemv_rows` back to 1)."""

    def __init__(self, message: str, rows: int) -> None:
        super().__init__(message)
        self.rows = rows


def _gemv(x: torch.Tensor, w: torch.Tensor, **kwargs) -> torch.Tensor:
    """`kernels.gemv.gemv`, its failures (but running out of memory) raised as `GemvError`."""
    from layersplit.shards.kernels import gemv  # (Triton: imported where it runs)

    try:
        if isinstance(w, torch.Tensor):
            return gemv.gemv(x, w, **kwargs)
        kwargs.pop("head", None)
        kwargs.pop("bias", None)  # (a module kept quantized holds its own)
        return module_gemv(x, w, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        raise GemvError(f"{type(e).__name__}: {e}", x.shape[0]) from e


class FusedDecode:
    """Callable installed as `DecoderLayer.fast` on every layer of a GPU range."""

    def __init__(self, compile: bool = True, kernels: bool | None = None) -> None:
        self.single = _Stages(pre_attention, post_attention, compile)
        self.batched = _Stages(pre_attention_batch, post_attention_batch, compile,
                               post_attention_moe_batch)
        self.kernels = kernels  # the Triton kernels; None: decided by the device at first use
        # id(layer) -> (weight, eps) of the input norm of the layer after it, in the same range
        self.next_norm: dict[int, tuple[torch.Tensor, float]] = {}
        # (h, norm(h)): the last layer's output and the next layer's normalized input
        self._normed: tuple[torch.Tensor, torch.Tensor] | None = None
        # eager steps of a dense layer through the row kernels (`prefill`); off after a failure
        self.prefill_kernels = True
        # steps of up to `gemv_rows` rows (one by default: batch-1 decode) of a dense layer
        # through the GEMV kernels (`kernels.gemv`) where the kernels run; off after a failure
        self.gemv = gemv_kernels_available()
        self.gemv_rows = gemv_max_rows()
        self.head_gemv = True  # the LM head's (`head`), off after its own failure
        self.fused_route = switched_on(FUSED_ROUTE_SWITCH)  # (`_fused_route`)
        # the head takes the few-rows kernel on more rows than the layers do: at 8-32 rows of
        # the default model's head it took 18-21 us against cuBLAS's 37-42 (H200, `bench/
        # gemv_sweep.py --rows`), where the layers' projections lost to cuBLAS
        self.head_rows = max(self.gemv_rows, HEAD_GEMV_ROWS)

    @property
    def compiled(self) -> bool:
        """Whether single-sequence steps run compiled (False after a compiler failure)."""
        return self.single.compiled

    def __call__(self, layer, h, cos, sin, kv, index, slot, step):
        stages = self.single if step.lo is None else self.batched
        while True:  # each failure switches one thing off: the compiled stages, the kernels
            try:
                return self._run(stages, layer, h, cos, sin, kv, index, slot, step)
            except (torch.cuda.OutOfMemoryError, IndexError):
                raise
            except Exception as e:  # noqa: BLE001 - a failing stage falls back, below
                err = e
            # a dense layer on the kernels, and a sparse layer's one-row step (`_moe_row`),
            # run nothing compiled: what failed was a kernel
            on_kernels = self.kernels and (not hasattr(layer.mlp, "experts") or
                                           self._moe_row_takes(layer, h))
            if isinstance(err, GemvError):
                self._gemv_failed(err)
            elif stages.compiled and not on_kernels:
                log.warning("torch.compile of the decode step failed (%s: %s); running it "
                            "eager", type(err).__name__, err)
                stages.uncompile()
            elif self.kernels:
                log.warning("the Triton decode kernels failed (%s: %s); running the torch "
                            "decode step", type(err).__name__, err)
                self.kernels = False
            else:
                raise err

    def _run(self, stages: _Stages, layer, h, cos, sin, kv, index, slot, step):
        if self.kernels is None:
            self.kernels = fused_kernels_available(h.device)
        if self.kernels:
            return self._run_kernels(stages, layer, h, cos, sin, kv, index, slot, step)
        if _kept(layer):  # (weights kept quantized: the compiled stages read plain weights)
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv, index, slot, step)
            return h + layer.mlp(layer.post_attention_layernorm(h))
        a, m = layer.self_attn, layer.mlp
        eps = layer.input_layernorm.eps
        q, k, v = stages.pre(h, layer.input_layernorm.weight, a.qkv_proj.weight,
                             a.qkv_proj.bias, None if a.q_norm is None else a.q_norm.weight,
                             None if a.k_norm is None else a.k_norm.weight,
                             cos, sin, eps, a.num_heads, a.num_kv_heads, a.head_dim,
                             step.lo is None)
        if step.lo is None:
            keys, values = kv.append(index, slot, step, k, v)
            attn = a._grouped(q, keys, values, step.mask_for(a.window))
        else:
            keys, values = kv.append_batch(index, step, k, v)
            attn = a._grouped_batch(q, keys, values, step.mask_for(a.window))
        if hasattr(m, "experts"):  # a sparse MLP: `shards.fused_moe`
            return stages.post_moe(h, attn, *moe_args(layer))
        return stages.post(h, attn, a.o_proj.weight, layer.post_attention_layernorm.weight,
                           m.gate_up_proj.weight, m.down_proj.weight, eps)


    def _gemv_takes(self, layer, h) -> bool:
        """Whether a step on the kernels runs through the GEMV kernels: at most `gemv_rows`
        rows, a dense layer, the GEMV kernels on (`gemv`)."""
        return bool(self.kernels) and self.gemv and h.shape[0] <= self.gemv_rows and \
            h.is_contiguous() and not hasattr(layer.mlp, "experts") and \
            (h.shape[0] <= QUANT_GEMV_ROWS or not _kept(layer))

    def _moe_row_takes(self, layer, h) -> bool:
        """Whether a sparse layer's step runs `_moe_row`: one row (`gemv_rows`), the kernels
        and GEMV kernels on, weights not kept quantized, no shared expert (Qwen2-MoE's gated
        one takes the compiled stage)."""
        m = layer.mlp
        ex = getattr(m, "experts", None)
        return bool(self.kernels) and self.gemv and h.shape[0] <= min(1, self.gemv_rows) and \
            h.is_contiguous() and type(ex) is routed_moe.Experts and not _kept(layer) and \
            getattr(m, "shared_expert", None) is None and routed_moe.few_rows_kernels(h) and \
            ex.gate_up_proj is not None and ex.gate_up_proj.is_contiguous() and \
            ex.down_proj.is_contiguous() and m.gate.weight.dtype == h.dtype and \
            not kernel_failed("MoE GEMV") and \
            not kernel_failed("MoE routing")

    def _moe_row(self, layer, h, attn, eps: float):
        """`fused_moe.post_attention_moe` of one row through kernels, nothing compiled: o_proj
        with the residual add as a GEMV (cuBLAS split it in two launches at one row), the
        router's GEMV with the norm as its prologue (its program 0 writes the normed row for
        the experts), the routing (in the router's launch with `FUSED_ROUTE_SWITCH` on), and
        the experts' kernels, the last adding the residual: six launches (five)."""
        a, m = layer.self_attn, layer.mlp
        h = _gemv(attn, _weight(a.o_proj), residual=h)
        x = torch.empty_like(h)
        dtype = None if m.float_weights else x.dtype
        norm = (layer.post_attention_layernorm.weight, eps)
        routed = self._fused_route(m, h, norm, x, dtype)
        if routed is None:
            logits = _gemv(h, m.gate.weight, norm=norm, norm_out=x)
            routed = routed_moe._kernels.moe_route(logits, m.top_k, m.norm_topk_prob, dtype)
        w, idx = routed
        return routed_moe._kernels.run_gemv(x, w, idx, m.experts.gate_up_proj,
                                            m.experts.down_proj, residual=h)

    def _fused_route(self, m, h, norm, x, dtype):
        """(weights, expert ids) of `_moe_row`'s router GEMV with the routing in its launch
        (`gemv.gemv_route`, `FUSED_ROUTE_SWITCH`), or None (the two launches then): switched
        off, failed once, or inside a capture before the layer's counter exists (it is made
        outside one: memory of a graph's pool could outlive its graph)."""
        if not self.fused_route or kernel_failed(FUSED_ROUTE):
            return None
        from layersplit.shards.kernels.gemv import gemv_route, route_counter

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        counter = getattr(m, "route_counter", None)
        if counter is None or counter.device != h.device:
            if capturing:
                return None
            counter = m.route_counter = route_counter(h.device)

        def call():
            return gemv_route(h, m.gate.weight, counter, m.top_k, m.norm_topk_prob, norm=norm,
                              norm_out=x, weights_dtype=dtype)
        # (a failure inside a capture is the capture's: raised, not retried)
        return call() if capturing else try_kernel(FUSED_ROUTE, call)

    def _run_kernels(self, stages: _Stages, layer, h, cos, sin, kv, index, slot, step):
        """A layer's step through the decode-attention kernel; few rows through the GEMV
        kernels (`kernels.gemv`: the norms, residual adds and SiLU * up folded into the
        projections), else its output normalized for the next layer as well when that layer
        is in the range (see the module doc)."""
        a, m = layer.self_attn, layer.mlp
        eps = layer.input_layernorm.eps
        few_rows = self._gemv_takes(layer, h)
        moe_row = not few_rows and self._moe_row_takes(layer, h)
        if few_rows or moe_row:
            self._normed = None
            qkv = _gemv(h, _weight(a.qkv_proj), bias=getattr(a.qkv_proj, "bias", None),
                        norm=(layer.input_layernorm.weight, eps))
        else:
            qkv = self._qkv(layer, h)
        attn = kernel_attention(a, qkv, cos, sin, kv, index, slot, step, eps)
        if moe_row:
            return self._moe_row(layer, h, attn, eps)
        if hasattr(m, "experts"):  # a sparse MLP (its output is not normed ahead)
            return stages.post_moe(h, attn, *moe_args(layer))
        if few_rows:
            h = _gemv(attn, _weight(a.o_proj), residual=h)
            act = _gemv(h, _weight(m.gate_up_proj), gate_up=True,
                        norm=(layer.post_attention_layernorm.weight, eps))
            return _gemv(act, _weight(m.down_proj), residual=h)
        return self._dense_rest(layer, h, attn, eps)

    def head(self, model, h):
        """The last range's final norm and LM head of few rows (`head_rows`) as one GEMV kernel
        (the norm its prologue), the logits stored as float32: a decode step's, and the last
        row of an eager step's (a prefill chunk's). None where it does not apply (more rows, a
        norm other than RMSNorm, a head the kernel does not take, the kernels off, or after the
        head's kernel failed: `head_gemv`, apart from the layers' `gemv`)."""
        if self.kernels is None:
            self.kernels = fused_kernels_available(h.device)
        head = model.lm_head
        kept = isinstance(head, (QuantLinear, *KEPT_LINEARS))  # (kept quantized: its blocks)
        w = head if kept else head.weight
        # (the few-rows head beyond the layers' `gemv_rows` was measured on a hidden of 576)
        rows = self.head_rows if head.in_features <= HEAD_GEMV_MAX_K else \
            min(self.gemv_rows, self.head_rows)
        if kept:
            rows = min(rows, QUANT_GEMV_ROWS)
        if not self.kernels or not self.gemv or not self.head_gemv or \
                h.shape[0] > rows or not h.is_contiguous() or \
                type(model.norm) is not RMSNorm or kept and not gemv_takes(head) or \
                not kept and (w.dtype != h.dtype or w.stride() != (w.shape[1], 1)):
            return None
        try:
            return _gemv(h, w, norm=(model.norm.weight, model.norm.eps), out_dtype=torch.float32,
                         head=True)
        except GemvError as e:  # the torch head runs from now on
            if e.rows > 1:  # (the head's own launch shape: the layers keep theirs)
                log.warning("the Triton few-rows GEMV kernel of the LM head failed on %d rows "
                            "(%s); heads of more than one row run cuBLAS", e.rows, e)
                self.head_rows = 1
            else:
                log.warning("the Triton GEMV kernel of the LM head failed (%s); the head runs "
                            "cuBLAS", e)
                self.head_gemv = False
            return None

    def _gemv_failed(self, err: GemvError) -> None:
        """Turn off what failed: the few-rows kernel (steps of more than one row go back to
        cuBLAS), or the one-row kernels."""
        if err.rows > 1:
            log.warning("the Triton few-rows GEMV kernel failed on %d rows (%s); steps of more "
                        "than one row run cuBLAS", err.rows, err)
            self.gemv_rows = self.head_rows = 1
        else:
            log.warning("the Triton GEMV kernels failed (%s); steps run cuBLAS", err)
            self.gemv = False

    def _qkv(self, layer, h):
        """The q/k/v projection of the layer's normed input: the norm the layer before
        computed with its output (`_normed`, taken), else the row kernel's."""
        from layersplit.shards.kernels import row_ops

        a = layer.self_attn
        normed, self._normed = self._normed, None
        x = normed[1] if normed is not None and normed[0] is h else \
            row_ops.rms_norm_rows(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
        return linear(a.qkv_proj, x)

    def _dense_rest(self, layer, h, attn, eps: float):
        """A dense layer after attention (`dense_after_attention`), the next layer's input
        norm kept for that layer (`_normed`) when it is in the range."""
        out, nxt = dense_after_attention(layer, h, attn, eps, self.next_norm.get(id(layer)))
        if nxt is not None:
            self._normed = (out, nxt)
        return out

    def prefill(self, layer, h, cos, sin, kv, index, slot, step):
        """An eager step of one sequence (a prefill chunk, a long verify step), or of several
        (`StepInfo.segments`), of a Llama-like layer through the row kernels around flash
        attention (`attend`): the q/k norm with the rotary in one kernel, the residual adds
        with their norms, SiLU * up; the output normed for the next layer as the decode step
        does. About 12 kernels a dense layer where the torch layer launches ~40, whose
        elementwise kernels cost a large model a quarter of its prefill's GPU time. A sparse
        layer's MLP is its own module (`RoutedMoE`), after the add + norm kernel. None where
        it does not apply: a step smaller than `PREFILL_KERNELS_MIN_ELEMENTS`, or once a
        kernel failed (the caller's torch layer runs: it rewrites the same KV rows)."""
        if not self.prefill_kernels or step.lo is not None or \
                not prefill_kernels_take(*h.shape):
            return None
        if self.kernels is None:
            self.kernels = fused_kernels_available(h.device)
        if not self.kernels:
            return None
        try:
            return self._prefill(layer, h, cos, sin, kv, index, slot, step)
        except (torch.cuda.OutOfMemoryError, IndexError):
            raise
        except Exception as e:  # noqa: BLE001 - the torch layer runs from now on
            log.warning("the Triton prefill kernels failed (%s: %s); eager steps run the torch "
                        "layers", type(e).__name__, e)
            self.prefill_kernels = False
            self._normed = None
            return None

    @staticmethod
    def _attend(a, q, k, v, kv, index, slot, step, stored: bool = False):
        """One sequence's eager attention: its K/V rows written (`stored`: they were, by
        `rope_qk`), then flash attention over its keys (`attend`), under its own causal or
        windowed mask."""
        mask = step.mask_for(a.window)
        keys, values = kv.gather(index, slot, step, k, v) if stored else \
            kv.append(index, slot, step, k, v)
        return attend(q, keys, values, mask, step.causal and mask is step.mask, a.sdpa_scale)

    def warm_prefill(self, layer) -> None:
        """Launch `prefill`'s kernels once on two rows of zeros, so that their compilation (a
        fresh machine's; later a load from Triton's cache) is paid at start, not by the first
        request: its own (`rope_qk`, with and without a pool to store K/V rows in), and the
        row kernels around the projections, which the captured one-row steps no longer launch
        (they take the GEMV kernels): the input norm, the add + norm with and without a next
        norm, SiLU * up. A failure turns `prefill` off, as one in a step would."""
        if not self.prefill_kernels:
            return
        a = layer.self_attn
        w = layer.input_layernorm.weight  # (the run's dtype and device)
        if self.kernels is None:
            self.kernels = fused_kernels_available(w.device)
        if not self.kernels:
            return
        d = a.head_dim
        try:
            from layersplit.shards.kernels import row_ops

            qkv = torch.zeros(2, a.qkv_proj.out_features, dtype=w.dtype, device=w.device)
            cos = torch.zeros(2, d, dtype=w.dtype, device=w.device)
            # its two variants: alone, and storing the K/V rows in a paged pool of the run's
            # dtype (`_prefill`; a kernel of its own), here a pool of two rows of its own
            rows = torch.zeros(2, a.num_kv_heads, d, dtype=w.dtype, device=w.device)
            for pool in (None, (rows, rows.clone(), torch.arange(2, device=w.device))):
                row_ops.rope_qk(qkv, cos, cos, a.num_heads, a.num_kv_heads,
                                None if a.q_norm is None else a.q_norm.weight,
                                None if a.k_norm is None else a.k_norm.weight,
                                layer.input_layernorm.eps if a.q_norm is None else a.q_norm.eps,
                                pool)
            norm = layer.input_layernorm
            h = torch.zeros(2, norm.weight.shape[0], dtype=w.dtype, device=w.device)
            row_ops.rms_norm_rows(h, norm.weight, norm.eps)
            row_ops.add_rms_norm(h, h, norm.weight, norm.eps)
            row_ops.add_rms_norm(h, h, None, 0.0)
            gate_up = getattr(layer.mlp, "gate_up_proj", None)  # (a dense MLP, fused)
            if gate_up is not None:
                row_ops.silu_mul(torch.zeros(2, gate_up.out_features, dtype=w.dtype,
                                             device=w.device))
        except Exception as e:  # noqa: BLE001 - eager steps run the torch layers
            log.warning("the Triton prefill kernels failed at start (%s: %s); eager steps run "
                        "the torch layers", type(e).__name__, e)
            self.prefill_kernels = False

    def _prefill(self, layer, h, cos, sin, kv, index, slot, step):
        from layersplit.shards.kernels import row_ops  # (Triton: imported where it runs)

        a = layer.self_attn
        eps = layer.input_layernorm.eps
        qkv = self._qkv(layer, h)
        nh, ng, d = a.num_heads, a.num_kv_heads, a.head_dim
        # one sequence's rows over a paged pool of the run's dtype: the rotary kernel stores
        # its K/V rows too (no index_copy_ launches)
        pool = kv.step_pool(index, slot, step) if not step.parts and \
            isinstance(kv, PagedKVCache) and kv.k_store.dtype == qkv.dtype else None
        q, k = rope_qk_rows(a, qkv, cos, sin, eps, pool)
        v = qkv[:, (nh + ng) * d:].view(-1, ng, d)
        attn = torch.cat([self._attend(a, q[lo:hi], k[lo:hi], v[lo:hi], kv, index, part_slot,
                                       part)
                          for part_slot, part, lo, hi in step.parts]) if step.parts else \
            self._attend(a, q, k, v, kv, index, slot, step, pool is not None)
        if hasattr(layer.mlp, "experts"):  # a sparse MLP: the add + norm kernel, then its own
            h, x = row_ops.add_rms_norm(h, linear(a.o_proj, attn),
                                        layer.post_attention_layernorm.weight, eps)
            return h + layer.mlp(x)
        return self._dense_rest(layer, h, attn, eps)


def kernel_takes(a) -> bool:
    """Whether the decode-attention kernel takes attention `a` of a layer outside the Llama
    layout: heads a power of two of at least 16 wide, q/k norms (if any) Llama's `RMSNorm`
    (not Gemma's offset ones). Its rotary must also span the head: checked at each step
    (`Attention.forward`)."""
    d = a.head_dim
    return d >= 16 and d & (d - 1) == 0 and a.qkv_proj is not None and \
        all(n is None or type(n) is RMSNorm for n in (a.q_norm, a.k_norm))


def kernel_attention(a, qkv, cos, sin, kv, index, slot, step, eps: float) -> torch.Tensor:
    """Attention `a`'s output (before o_proj) for a graph step's q/k/v rows `qkv`, through the
    decode-attention kernel, which also applies the q/k norms (eps `eps`) and the rotary and
    writes the step's K/V rows into layer `index` of `kv`."""
    if step.lo is None:  # one sequence: n rows written at `rows` of `slot`
        rows = step.positions if step.rows is None else step.rows
        slot0, n_seqs = slot, 1
    else:  # a batched step: `seq_rows` rows of each sequence (one per decode row); a
        # padding row's scratch row is not written
        rows = step.positions if step.rows is None else step.rows
        slot0, n_seqs = step.lo, qkv.shape[0] // step.seq_rows
    if step.kv_len > kv.max_len:
        raise IndexError(f"KV cache holds {kv.max_len} tokens; step needs {step.kv_len}")
    tables = None
    if isinstance(kv, PagedKVCache):  # each sequence's block table
        tables = step.tables
        if tables is None:
            tables = kv.table[slot:slot + 1] if step.lo is None else kv.table[step.slots]
    return decode_attention(
        qkv, cos, sin, kv.k_store[index], kv.v_store[index], rows, slot0,
        step.mask_for(a.window), n_seqs, a.num_heads,
        None if a.q_norm is None else a.q_norm.weight,
        None if a.k_norm is None else a.k_norm.weight, eps, None, tables, a.sinks, a.scale)


def decode_attention(*args):
    """`shards.kernels.decode_attention.decode_attention`, imported on first use (Triton is
    never imported where the kernels do not run)."""
    from layersplit.shards.kernels.decode_attention import decode_attention as kernel

    return kernel(*args)


def warm_prefill(model) -> None:
    """`FusedDecode.warm_prefill` for a range's fused layers (they share one, and one shape of
    heads)."""
    for layer in model.layers:
        fast = getattr(layer, "fast", None)
        if isinstance(fast, FusedDecode):
            fast.warm_prefill(layer)
            return


def fuse_projections(model, compile: bool = True, kernels: bool | None = None) -> None:
    """Fuse q/k/v and gate/up weights of every layer and install the fused decode step.
    `kernels`: use the Triton decode kernels (None: where `fused_kernels_available`)."""
    from layersplit.shards.fused_hybrid import fuse_hybrid
    from layersplit.shards.models import llama, moe_llama
    from layersplit.shards.models.qwen3_5 import HybridRange

    if isinstance(model, HybridRange):  # its own fused step
        fuse_hybrid(model, compile)
        return
    fast = FusedDecode(compile, kernels)
    if getattr(model, "is_last", False) and fast.kernels is not False:  # (a range, not a draft)
        model.head_fast = fast.head
    layers = list(model.layers)
    # the Llama layout, its MLP dense or sparse (`shards.fused_moe`); other families: their own
    ok = [type(layer) in (llama.DecoderLayer, moe_llama.DecoderLayer) for layer in layers]
    for i, (layer, fuse) in enumerate(zip(layers, ok)):
        if fuse:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            # weights kept quantized (`shards.quant_load`): the fused step where the GEMV of
            # `kernels.quant_gemv` takes every projection of a dense layer, else the layer's
            # own modules
            layer.kept_quantized = any(is_quantized(m) for m in layer.modules())
            if layer.kept_quantized:
                a, m = layer.self_attn, layer.mlp
                ok[i] = not hasattr(m, "experts") and fast.kernels is not False and \
                    gemv_takes(a.qkv_proj) and gemv_takes(a.o_proj) and \
                    gemv_takes(m.gate_up_proj, gate_up=True) and gemv_takes(m.down_proj)
            if ok[i]:
                layer.fast = fast
        else:
            if hasattr(layer, "fuse_weights"):  # unfused, but its weights in the GPU layout
                layer.fuse_weights()
            # where the Triton kernels run: its norms one kernel each (eight eager kernels
            # each), its projections of one row the GEMV kernel, and its graph steps' attention
            # the decode-attention kernel where the layer attends as the Llama layout does
            # (sinks or not)
            dev = next(layer.parameters()).device
            if fast.kernels is not False and fused_kernels_available(dev):
                norms_as_row_kernels(layer)
                linears_as_gemv(layer)
                a = getattr(layer, "self_attn", None)
                if type(a) is Attention and kernel_takes(a):
                    a.graph_attention = kernel_attention
    unfused = [layer for layer in layers
               if type(layer) not in (llama.DecoderLayer, moe_llama.DecoderLayer)]
    if unfused:  # (said at start: which layers take the eager torch path, and why)
        log.info("%d of %d layers (%s) run unfused: %s", len(unfused), len(layers),
                 type(unfused[0]).__module__.rsplit(".", 1)[-1],
                 getattr(unfused[0], "UNFUSED_WHY", "the fused decode step is the Llama "
                         "layout's"))
    # a dense layer's post stage also norms its output for the next layer's projection
    dense = [fuse and not hasattr(layer.mlp, "experts") for layer, fuse in zip(layers, ok)]
    for i, (layer, nxt) in enumerate(itertools.pairwise(layers)):
        if dense[i] and ok[i + 1]:
            fast.next_norm[id(layer)] = (nxt.input_layernorm.weight, nxt.input_layernorm.eps)
