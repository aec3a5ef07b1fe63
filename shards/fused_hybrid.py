"""The GPU decode step of a hybrid layer (Qwen3.5, Qwen3-Next), its elementwise work fused by
torch.compile: `shards.fused`'s counterpart for `shards.models.qwen3_5`.

Eager, a one-token step of a Gated DeltaNet layer is ~50 kernels (four in-projections, the
conv's cat / conv1d / SiLU, the gates' casts, the norms' eight each...); inside a CUDA graph each
still costs a few microseconds, most of a 64-layer step's time beside the weights' reads. Here a
layer's step is three stages: `linear_pre` (input norm, one in-projection, the conv over the
slot's state, the gates), the delta rule (fla-core's recurrent kernel where it runs, else the
torch path; `shards.kernels.gated_delta_fla`), and `linear_post` (the gated output norm,
out_proj, residual, post-attention norm, SwiGLU MLP, residual). A full-attention layer is
`attn_pre` (norm, one q/k/v projection, q/k norms, partial rotary), the eager attention over the
KV cache, and `attn_post`. A mixture-of-experts MLP (Qwen3.5-MoE, Qwen3-Next) runs eager after
the post stage (`RoutedMoE`, its experts fused on the GPU). Weights are arguments, so one
compilation serves every layer of a kind.

One-token steps take this path: a sequence's (decode, and the rows of a verify step run row by
row: a tree's, deterministic mode's) and batched decode steps' (one row of each of B sequences,
their states gathered from their slots and written back); prefill chunks and chain verify steps
run the module's own forward, on the fused weights. Same
math as `shards.models.qwen3_5` but for summation order (the conv as a float32 sum of products);
the CPU tests compare the two uncompiled, the GPU tests compiled.

Where the GEMV kernels run (a GPU, or Triton's interpreter), a sequence's one-row steps take
`HybridFast._gemv_step` instead: the projections but q/k/v's as GEMV kernels with the norms,
residual adds and SiLU * up folded in, the rest of each stage compiled apart
(`LAYERSPLIT_HYBRID_GEMV=0`: the stages; the Qwen3.5-27B shape 1.069 x faster this way).

`LAYERSPLIT_FUSED_HYBRID=0` leaves hybrid layers unfused (the eager step, for comparisons).
"""

from __future__ import annotations

import logging
import os
import traceback

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import (
    fused_kernels_available,
    gemv_kernels_available,
    kernel_failed,
    note_kernel_failure,
    switched_off,
    switched_on,
)
from layersplit.shards.kernels.gated_delta_fla import pick_rule
from layersplit.shards.layers.attention import attend, attend_batch
from layersplit.shards.layers.gated_attention import apply_partial_rope, gate_output
from layersplit.shards.layers.gated_delta import recurrent_gated_delta_rule
from layersplit.shards.lazy_compile import compiled_on_first_call

log = logging.getLogger(__name__)

ENV_SWITCH = "LAYERSPLIT_FUSED_HYBRID"
# a sequence's one-row steps take the GEMV kernels for their projections but q/k/v's
# (`HybridFast._gemv_step`; 0: the compiled stages' cuBLAS GEMMs): the Qwen3.5-27B shape's
# batch 1 66.8 against 62.5 tok/s, 1.069 x (H200, 2026-12-01, bench/RESULTS.md D4)
GEMV_SWITCH = "LAYERSPLIT_HYBRID_GEMV"
GEMV = "GEMV"  # (`try_kernel`'s name of the GEMV kernels, `gemv_linear.KERNEL`'s)
# 1: the GEMV step's normed projections (the in-projection, gate/up) sum the row's squares in
# their weights' loop (`gemv(..., one_pass=True)`) instead of in a prologue of their own, which
# cost them most at Qwen3.5-27B's widths (`bench/gemv_sweep.py --zc`, H200: gate/up 83.09 us
# plain, 87.84 normed; the in-projection 39.07 plain, 49.19 normed; so the in-projection's norm
# runs apart, `zc_norm`, unless this is on). The normed row is then never rounded to the
# weights' dtype (the stages and transformers round it once): a difference within that dtype's
# rounding. Off: measured slower on the whole step (the Qwen3.5-27B shape's batch 1 65.4 against
# 67.0 tok/s, 0.976 x; H200, 2026-12-01, bench/RESULTS.md D4)
ONE_PASS_SWITCH = "LAYERSPLIT_HYBRID_ONE_PASS_NORM"
# 1: the GEMV step's delta rule is the verify rows' kernel at one row
# (`gated_delta_rows.recurrent_rows`), which inside a capture writes the state after the row over
# the state it read: the slot's recurrent state advanced in place, instead of fla-core's kernel into
# a new state and a copy back (the copy: 48 launches of ~3.2 us a Qwen3.5-27B step, H200); a batched
# step's rows read their slots' states in the pool and advance them there
# (`HybridFast._slots_rule`), instead of a gather, fla's kernel and a scatter. Outside a capture the
# kernel writes into a new state, copied back last, as fla's: an eager step that failed after it is
# run again (`HybridFast.__call__`) and must find the state as it was; and the eager warm-ups before
# a capture build and load the kernel, which a capture could not. On by default (0: fla-core's
# kernel and the copy, the gather and the scatter): the Qwen3.5-27B shape's 8 streams 398.4
# against 343.8 tok/s (1.16 x), batch 1 unchanged (66.8 / 66.7, 1.002 x; H200, 2026-12-01)
STATE_IN_PLACE_SWITCH = "LAYERSPLIT_HYBRID_STATE_IN_PLACE"
ROWS_KERNEL = "gated delta rule over slots"  # (the name `_rows_rule`'s kernel fails under)
# 1: the GEMV step's elementwise work between its GEMVs (the conv and gates, the gated norm, the
# attention's norms, rotary and output gate, the input norm) as Triton kernels of their own
# (`kernels.hybrid_row_ops`, `row_ops.rms_norm_rows`) instead of `GEMV_STAGES` and `attn_pre`
# compiled by torch.compile, and the same in the stages of batched steps (`_run`: their GEMMs
# cuBLAS's, the norms, residual adds and SiLU * up `row_ops`'s): a decode step then needs no
# Dynamo trace at each start and no inductor compile at a machine's first. Their rounding is
# the compiled stages' (`kernels.hybrid_row_ops` says why). On by default (0: the compiled
# stages). The Qwen3.5-27B shape on an H200, 2026-12-01, processes in turn: batch 1 68.6
# against 66.3 tok/s (1.035 x), 8 streams 388.0 against 373.2 (1.04 x); `layersplit generate`
# command to first token with warm caches 7.6 against 11.4 s, empty caches unchanged (22.3
# against 22.8 s); bfloat16 parity against transformers float32 top-1 0.9375, mean KL 5.15e-3
# against the compiled stages' 0.9444, 5.14e-3
ROW_KERNELS_SWITCH = "LAYERSPLIT_HYBRID_ROW_KERNELS"
ROW_KERNELS = "hybrid row kernels"  # (the name their failure turns them off under)


def zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`ZeroCentredRMSNorm`: RMSNorm scaled by (1 + w), in float32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + w.float())).to(x.dtype)


def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h + x rounded once to h's dtype, written in float32 so that inductor folds the add into
    the norm that reads the sum instead of making it a GEMM epilogue (a copy of h, then the
    GEMM adds it)."""
    return (h.float() + x.float()).to(h.dtype)


def _mlp(h, ln2_w, gu_w, down_w, eps: float):
    """h + SwiGLU(norm(h)), or h alone where the layer's MLP is sparse (`gu_w` None)."""
    if gu_w is None:
        return h
    g, u = F.linear(zc_norm(h, ln2_w, eps), gu_w).chunk(2, dim=-1)
    return residual(h, F.linear(F.silu(g) * u, down_w))


def linear_pre(h, ln_w, in_w, conv_w, conv_state, a_log, dt_bias, eps: float, conv_dim: int,
               key_dim: int, value_dim: int, hk: int, hv: int, dk: int, dv: int):
    """One token of each of B sequences (h (B, hidden)) through a Gated DeltaNet layer up to
    the delta rule: q, k (B, 1, Hk, Dk), v (B, 1, Hv, Dv), g (B, 1, Hv) float32, beta (B, 1,
    Hv), z (B, 1, Hv, Dv) and the new conv states (B, C, K - 1). `conv_state` (B, C, K - 1) is
    each sequence's, `conv_w` (C, K)."""
    return linear_conv(F.linear(zc_norm(h, ln_w, eps), in_w), conv_w, conv_state, a_log,
                       dt_bias, conv_dim, key_dim, value_dim, hk, hv, dk, dv)


def linear_conv(p, conv_w, conv_state, a_log, dt_bias, conv_dim: int, key_dim: int,
                value_dim: int, hk: int, hv: int, dk: int, dv: int):
    """`linear_pre` after its in-projection: `p` (B, conv + value + 2 Hv) its output."""
    n = p.shape[0]
    mixed, z, b, a = p.split([conv_dim, value_dim, hv, hv], dim=-1)
    full = torch.cat([conv_state.to(p.dtype), mixed[:, :, None]], dim=-1)  # (B, C, K)
    conv = (full.float() * conv_w.float()).sum(-1).to(p.dtype)  # the depthwise conv, one row
    conv = F.silu(conv)
    q, k, v = conv.split([key_dim, key_dim, value_dim], dim=-1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return (q.reshape(n, 1, hk, dk), k.reshape(n, 1, hk, dk), v.reshape(n, 1, hv, dv),
            g.reshape(n, 1, hv), b.sigmoid().reshape(n, 1, hv), z.reshape(n, 1, hv, dv),
            full[:, :, 1:])


def linear_post(h, o, z, norm_w, norm_eps: float, out_w, ln2_w, gu_w, down_w, eps: float):
    """The delta rule's output o (B, 1, Hv, Dv) through the gated norm and out_proj, added to h,
    then the MLP (dense; else h after the mixer)."""
    h = residual(h, F.linear(linear_gate(o, z, norm_w, norm_eps), out_w))
    return _mlp(h, ln2_w, gu_w, down_w, eps)


def linear_gate(o, z, norm_w, norm_eps: float):
    """The delta rule's output o (B, 1, Hv, Dv) through the gated norm: out_proj's input
    (B, Hv * Dv)."""
    o32 = o.float()
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + norm_eps)
    y = (norm_w * o32.to(o.dtype) * F.silu(z.float())).to(o.dtype)
    return y.reshape(o.shape[0], -1)


def attn_pre(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps: float, nh: int, ng: int, hd: int):
    """One token of each of B sequences: q (B, H, D), k, v (B, G, D) and the output gate
    (B, H * D) of a gated full-attention layer."""
    n = h.shape[0]
    qg, k, v = F.linear(zc_norm(h, ln_w, eps), qkv_w, qkv_b).split(
        [2 * nh * hd, ng * hd, ng * hd], dim=-1)
    q, gate = qg.view(n, nh, 2 * hd).chunk(2, dim=-1)
    q = apply_partial_rope(zc_norm(q, qn_w, eps), cos, sin)
    k = apply_partial_rope(zc_norm(k.reshape(n, ng, hd), kn_w, eps), cos, sin)
    return q, k, v.reshape(n, ng, hd), gate.reshape(n, nh * hd)


def attn_post(h, attn, gate, o_w, ln2_w, gu_w, down_w, eps: float):
    """h + o_proj(attn * sigmoid(gate)), then the MLP (as `linear_post`)."""
    h = residual(h, F.linear(gate_output(attn, gate), o_w))
    return _mlp(h, ln2_w, gu_w, down_w, eps)


STAGES = (linear_pre, linear_post, attn_pre, attn_post)


# the stages of a one-row step whose projections (but q/k/v's) run as GEMV kernels
# (`HybridFast._gemv_step`): the rest of each stage, compiled apart
GEMV_STAGES = (linear_conv, linear_gate, gate_output, zc_norm)


def row_kernel_conv(p, conv_w, conv_state, a_log, dt_bias, conv_dim: int, key_dim: int,
                    value_dim: int, hk: int, hv: int, dk: int, dv: int):
    """`linear_conv` through `hybrid_row_ops.conv_gates` (`ROW_KERNELS_SWITCH`)."""
    from layersplit.shards.kernels.hybrid_row_ops import conv_gates

    n = p.shape[0]
    conv, g, beta, new_conv = conv_gates(p, conv_w, conv_state, a_log, dt_bias, conv_dim,
                                         value_dim, hv)
    q, k, v = conv.split([key_dim, key_dim, value_dim], dim=-1)
    z = p[:, conv_dim:conv_dim + value_dim]
    return (q.reshape(n, 1, hk, dk), k.reshape(n, 1, hk, dk), v.reshape(n, 1, hv, dv),
            g.reshape(n, 1, hv), beta.reshape(n, 1, hv), z.reshape(n, 1, hv, dv), new_conv)


def row_kernel_gate(o, z, norm_w, norm_eps: float):
    """`linear_gate` through `hybrid_row_ops.gated_norm`."""
    from layersplit.shards.kernels.hybrid_row_ops import gated_norm

    return gated_norm(o, z, norm_w, norm_eps)


def row_kernel_output_gate(attn, qkv):
    """`gate_output`, its gate read in the q/k/v row (`row_kernel_attn_pre` hands it on)."""
    from layersplit.shards.kernels.hybrid_row_ops import sigmoid_gate

    qkv, nh, hd = qkv
    return sigmoid_gate(attn, qkv, nh, hd)


def row_kernel_norm(h, w32, eps: float):
    """`zc_norm` through `row_ops.rms_norm_rows`, with the float32 1 + w (`zc_weights`)."""
    from layersplit.shards.kernels.row_ops import rms_norm_rows

    return rms_norm_rows(h, w32, eps, float_product=True)


def row_kernel_attn_pre(h, ln32, qkv_w, qkv_b, qk32, cos, sin, eps: float, nh: int, ng: int,
                        hd: int):
    """`attn_pre` through the row kernels: the input norm (`ln32`: float32 1 + w), the q/k/v
    projection (its GEMM), then `hybrid_row_ops.zc_rope_qk` (`qk32`: the q and k norms' float32
    1 + w). Returns q, k, v and (the q/k/v rows, heads, width) for `row_kernel_output_gate`."""
    from layersplit.shards.kernels.hybrid_row_ops import zc_rope_qk

    qkv = F.linear(row_kernel_norm(h, ln32, eps), qkv_w, qkv_b)
    q, k = zc_rope_qk(qkv, cos, sin, qk32[0], qk32[1], eps, nh, ng, hd)
    v = qkv[:, 2 * nh * hd + ng * hd:].view(qkv.shape[0], ng, hd)
    return q, k, v, (qkv, nh, hd)


def row_kernel_mlp(h, x, ln2_32, gu_w, down_w, eps: float):
    """h + x rounded once, then (a dense MLP: `gu_w` not None) the SwiGLU MLP through the row
    kernels: the zero-centred norm of the float32 h + x (`ln2_32`: float32 1 + w), gate/up's
    GEMM, SiLU * up, down's GEMM, and h + x + down summed in float32 (`_mlp` after `residual`
    compiled: inductor recomputes h + x there rather than read it rounded,
    `hybrid_row_ops` says why its rounding is followed)."""
    from layersplit.shards.kernels.row_ops import add_rms_norm, silu_mul

    if gu_w is None:
        return add_rms_norm(h, x, None, 0.0)[0]
    normed = add_rms_norm(h, x, ln2_32, eps, float_product=True, float_sum=True)[1]
    act = silu_mul(F.linear(normed, gu_w), round_act=False)  # (rounded once, as `_mlp`)
    return add_rms_norm(h, x, None, 0.0, x2=F.linear(act, down_w))[0]


def row_linear_pre(h, ln32, in_w, conv_w, conv_state, a_log, dt_bias, eps: float,
                   conv_dim: int, key_dim: int, value_dim: int, hk: int, hv: int, dk: int,
                   dv: int):
    """`linear_pre` through the row kernels (`ln32`: the input norm's float32 1 + w)."""
    return row_kernel_conv(F.linear(row_kernel_norm(h, ln32, eps), in_w), conv_w, conv_state,
                           a_log, dt_bias, conv_dim, key_dim, value_dim, hk, hv, dk, dv)


def row_linear_post(h, o, z, norm_w, norm_eps: float, out_w, ln2_32, gu_w, down_w, eps: float):
    """`linear_post` through the row kernels (`ln2_32`: the post-attention norm's float32
    1 + w)."""
    return row_kernel_mlp(h, F.linear(row_kernel_gate(o, z, norm_w, norm_eps), out_w), ln2_32,
                          gu_w, down_w, eps)


def row_attn_post(h, attn, gate, o_w, ln2_32, gu_w, down_w, eps: float):
    """`attn_post` through the row kernels (`gate`: `row_kernel_attn_pre`'s)."""
    return row_kernel_mlp(h, F.linear(row_kernel_output_gate(attn, gate), o_w), ln2_32, gu_w,
                          down_w, eps)


ROW_KERNEL_STAGES = (row_kernel_conv, row_kernel_gate, row_kernel_output_gate)
# the launch shape of the step's GEMVs without a norm prologue on rows of 4,096 inputs or more
# (`bench/gemv_sweep.py --model qwen3.5-27b --ops gate_up,down,o --zc --block-n 1,2,4 --warps
# 2,4,8`, H200, 2026-12-01): down 46.09 -> 42.39 us against `gemv.config`'s (cuBLAS 50.11), o
# 17.26 -> 16.45 (cuBLAS 18.39). The in-projection takes its norm apart (`zc_norm`, compiled):
# with the norm as its prologue (8,240 programs each summing the row's squares) it took 49.19
# us against cuBLAS's 43.66
WIDE_ROWS = {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4}


def plain_launch(k: int) -> dict | None:
    """`gemv`'s `cfg` for a one-row projection of k inputs without a norm (None: its own)."""
    return dict(WIDE_ROWS) if k >= 4096 else None


# the most rows a batched step runs through the fused stages (each row count is a compilation
# of its own, and torch.compile allows 8 a function: 1, 2, 4 ... 64 are 7); larger batches run
# the module's forward
MAX_BATCH_ROWS = 64


def compile_failure(e: BaseException) -> bool:
    """Whether `e` came out of torch.compile (Dynamo, Inductor, or Triton compiling their
    kernels), not out of what the step ran."""
    return torch_compile_failure(e) or (type(e).__module__ or "").startswith("triton")


def torch_compile_failure(e: BaseException) -> bool:
    """Whether `e` came out of Dynamo or Inductor: its type is theirs, or (any error, a Triton
    one above all, in the GEMV step where our own Triton kernels run too) the last frame it
    passed through outside Triton is Inductor's runtime or code Inductor generated
    (`inductor_raised`): then the stages run uncompiled and the GEMV kernels stay on."""
    return (type(e).__module__ or "").startswith(("torch._dynamo", "torch._inductor")) or \
        inductor_raised(e)


def inductor_raised(e: BaseException) -> bool:
    """Whether the innermost frame of `e`'s traceback outside Triton's own package (and
    outside code made with `exec`, `<string>`, as Inductor's fallback launchers are) is in
    torch's Inductor (its runtime, which compiles and launches the kernels it generated) or in
    a module Inductor generated (under TORCHINDUCTOR_CACHE_DIR, which Inductor and
    `shards.compile_cache` set to an absolute folder)."""
    triton_dir = _triton_dir()
    last = None
    for frame, _ in traceback.walk_tb(e.__traceback__):
        name = frame.f_code.co_filename
        if not name.startswith("<") and not (triton_dir and name.startswith(triton_dir)):
            last = name
    if last is None:
        return False
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return f"{os.sep}_inductor{os.sep}" in last or \
        bool(cache) and last.startswith(os.path.join(cache, ""))


def _triton_dir() -> str | None:
    """Triton's package folder (with a trailing separator), or None where it is missing."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    return os.path.join(os.path.dirname(spec.origin), "")


class HybridFast:
    """Callable installed as `HybridLayer.fast` on every layer of a GPU hybrid range."""

    def __init__(self, compile: bool = True) -> None:
        self.compiled = compile
        self.stages = tuple(compiled_on_first_call(f) if compile else f for f in STAGES)
        self.gemv_stages = tuple(compiled_on_first_call(f) if compile else f
                                 for f in GEMV_STAGES)
        self.gemv = not switched_off(GEMV_SWITCH)  # (read once: the switch of `_gemv_step`)
        self.one_pass = switched_on(ONE_PASS_SWITCH)
        self.state_in_place = not switched_off(STATE_IN_PLACE_SWITCH)
        self.row_kernels = not switched_off(ROW_KERNELS_SWITCH)

    def uncompile(self) -> None:
        self.stages, self.gemv_stages, self.compiled = STAGES, GEMV_STAGES, False

    def __call__(self, layer, h, cos, sin, kv, index, slot, step):
        try:
            if self._gemv_takes(layer, h, step):
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    # (a failure inside a capture is the capture's: raised, not retried)
                    return self._gemv_step(layer, h, cos, sin, kv, index, slot, step)
                got = self._try_gemv_step(layer, h, cos, sin, kv, index, slot, step)
                if got is not None:
                    return got
            return self._run_stages(layer, h, cos, sin, kv, index, slot, step)
        except (torch.cuda.OutOfMemoryError, IndexError):
            raise
        except Exception as e:
            if not self.compiled or not compile_failure(e) or (
                    torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                raise  # (a kernel's or a capture's failure: not torch.compile's)
            log.warning("torch.compile of the hybrid decode step failed (%s: %s); running it "
                        "eager", type(e).__name__, e)
        self.uncompile()
        return self._run(layer, h, cos, sin, kv, index, slot, step)

    def _run_stages(self, layer, h, cos, sin, kv, index, slot, step):
        """`_run`, through the row kernels where they take the step (`_row_stages_take`): on
        their failure (outside a capture) they are off, and the step runs again without them
        (the slot's states advance last: as they were)."""
        rows = self._row_stages_take(layer, h)
        try:
            return self._run(layer, h, cos, sin, kv, index, slot, step, rows=rows)
        except (torch.cuda.OutOfMemoryError, IndexError):
            raise
        except Exception as e:  # noqa: BLE001 - theirs, or raised again below
            if not rows or (torch.cuda.is_available() and
                            torch.cuda.is_current_stream_capturing()):
                raise
            note_kernel_failure(ROW_KERNELS, e)
        return self._run(layer, h, cos, sin, kv, index, slot, step)

    def _row_stages_take(self, layer, h) -> bool:
        """Whether `_run`'s stages run through the row kernels (`ROW_KERNELS_SWITCH`): switched
        on, not failed, the Triton kernels running there, and the layer's float32 norm scales
        made (`fuse_hybrid`, with the GEMV step)."""
        zc = getattr(layer, "zc_weights", None)
        return self._row_kernels_take() and zc is not None and zc[0].device == h.device and (
            layer.linear or getattr(layer, "qk_zc_weights", None) is not None) and \
            fused_kernels_available(h.device)

    def _run(self, layer, h, cos, sin, kv, index, slot, step, rows: bool = False):
        lin_pre, lin_post, _, att_post = self.stages  # (attn_pre: `_attn_pre`)
        eps = layer.input_layernorm.eps
        mlp = layer.mlp
        dense = getattr(mlp, "gate_up_proj", None)
        ln_w = layer.input_layernorm.weight
        mlp_w = ((layer.post_attention_layernorm.weight, dense.weight, mlp.down_proj.weight)
                 if dense is not None else (None, None, None))
        if rows:  # (the same stages through the row kernels: float32 1 + w for the norms)
            lin_pre, lin_post, att_post = row_linear_pre, row_linear_post, row_attn_post
            ln_w, ln2_32 = layer.zc_weights
            mlp_w = (ln2_32, *mlp_w[1:])
        batched = step.lo is not None  # (one row of each sequence, its states in step.states)
        indexed = batched and self._rows_kernel_takes(h)  # (`STATE_IN_PLACE_SWITCH`)
        if layer.linear:
            a = layer.linear_attn
            if indexed:  # (the recurrent states read in their slots by the rows kernel)
                conv_state, state = kv.conv[index].index_select(0, step.states), None
            elif batched:  # (gathered copies, written back below)
                conv_state, state = kv.gather_states(index, step.states)
            else:
                conv_state, state = kv.conv[index, slot:slot + 1], kv.state[index, slot:slot + 1]
            q, k, v, g, beta, z, new_conv = lin_pre(
                h, ln_w, a.in_proj.weight, a.conv1d.weight.squeeze(1), conv_state, a.A_log,
                a.dt_bias, eps, a.conv_dim, a.key_dim, a.value_dim, a.num_k_heads,
                a.num_v_heads, a.head_k_dim, a.head_v_dim)
            if indexed:
                o, new_state = self._slots_rule(q, k, v, g, beta, kv.state[index], step.states)
            else:
                rule = pick_rule(h.device, True, recurrent_gated_delta_rule)
                o, new_state = rule(q, k, v, g, beta, state)
            h = lin_post(h, o, z, a.norm.weight, a.norm.eps, a.out_proj.weight, mlp_w[0],
                         mlp_w[1], mlp_w[2], eps)
            # the slot's states advance last: a stage that fails before this (and is run
            # again, eager, by `__call__`) leaves them as they were
            advance = (conv_state, state, new_conv, new_state)
        else:
            advance = None
            a = layer.self_attn
            q, k, v, gate = self._attn_pre(layer, h, cos, sin, eps, rows)
            if batched:
                keys, values = kv.append_batch(index, step, k, v)  # (B, T, G, D) each
                out = attend_batch(q, keys, values, step.mask, a.head_dim ** -0.5)
            else:
                keys, values = kv.append(index, slot, step, k, v)  # (T, G, D) each
                out = attend(q, keys, values, step.mask, False)
            h = att_post(h, out, gate, a.o_proj.weight, mlp_w[0], mlp_w[1], mlp_w[2], eps)
        if dense is None:  # a sparse MLP, eager
            h = h + mlp(layer.post_attention_layernorm(h))
        if advance is not None:
            conv_state, state, new_conv, new_state = advance
            if indexed:  # (the recurrent states advanced in their slots, or to copy there)
                kv.conv[index].index_copy_(0, step.states, new_conv)
                if new_state is not None:
                    kv.state[index].index_copy_(0, step.states, new_state)
            elif batched:
                kv.scatter_states(index, step.states, new_conv, new_state)
            else:
                conv_state.copy_(new_conv)
                state.copy_(new_state)
        return h

    def _try_gemv_step(self, layer, h, cos, sin, kv, index, slot, step):
        """`_gemv_step`, or None where a GEMV kernel failed (the GEMV kernels are off from then
        on, `note_kernel_failure`; the stages run). A failure of torch.compile in its compiled
        stages is raised, for `__call__` to run the stages uncompiled, not taken for the
        kernels'. It fails before the slot's states advance (they advance last). Where the row
        kernels ran (`ROW_KERNELS_SWITCH`), any failure turns them off first and the step runs
        again without them: a failure that was not theirs then fails again, as the GEMV's."""
        rows = self._row_kernels_take()
        try:
            return self._gemv_step(layer, h, cos, sin, kv, index, slot, step)
        except (torch.cuda.OutOfMemoryError, IndexError):
            raise
        except Exception as e:  # noqa: BLE001 - sorted below
            if self.compiled and torch_compile_failure(e):
                raise
            if rows:  # (the row kernels off first, under their own name; then the step again)
                note_kernel_failure(ROW_KERNELS, e)
                return self._try_gemv_step(layer, h, cos, sin, kv, index, slot, step)
            note_kernel_failure(GEMV, e)
            return None

    def _attn_pre(self, layer, h, cos, sin, eps: float, rows: bool):
        """A gated-attention layer's `attn_pre`: the compiled stage's, or with `rows` the row
        kernels' (`row_kernel_attn_pre`, its norms' float32 1 + w from `fuse_hybrid`; its gate
        then (the q/k/v rows, heads, width), read in place by `row_kernel_output_gate`)."""
        a = layer.self_attn
        if rows:
            return row_kernel_attn_pre(h, layer.zc_weights[0], a.qkv_proj.weight,
                                       a.qkv_proj.bias, layer.qk_zc_weights, cos, sin, eps,
                                       a.num_heads, a.num_kv_heads, a.head_dim)
        return self.stages[2](h, layer.input_layernorm.weight, a.qkv_proj.weight,
                              a.qkv_proj.bias, a.q_norm.weight, a.k_norm.weight, cos, sin, eps,
                              a.num_heads, a.num_kv_heads, a.head_dim)

    def _row_kernels_take(self) -> bool:
        """Whether a GEMV step's elementwise work runs as `kernels.hybrid_row_ops`'s kernels
        (`ROW_KERNELS_SWITCH`): switched on and not failed (the GEMV step's own predicate,
        `_gemv_takes`, says the Triton kernels run there)."""
        return self.row_kernels and not kernel_failed(ROW_KERNELS)

    def _gemv_takes(self, layer, h, step) -> bool:
        """Whether a step takes `_gemv_step`: switched on, one row of one sequence, the GEMV
        kernels running there, the layer's zero-centred norms prepared (`fuse_hybrid`) on the
        row's device, the row contiguous in the weights' dtype."""
        zc = getattr(layer, "zc_weights", None)
        return self.gemv and step.lo is None and h.dim() == 2 and h.shape[0] == 1 and \
            zc is not None and zc[0].device == h.device and h.is_contiguous() and \
            h.dtype == layer.input_layernorm.weight.dtype and gemv_kernels_available() and \
            fused_kernels_available(h.device) and not kernel_failed(GEMV)

    def _gemv_step(self, layer, h, cos, sin, kv, index, slot, step):
        """`_run` of one row with its projections as GEMV kernels (`kernels.gemv`): the
        post-attention norm as gate/up's prologue (zero-centred: a float32 1 + w,
        `float_product`), the input norm apart (`zc_norm`, compiled: `WIDE_ROWS` says why;
        with `ONE_PASS_SWITCH` on, both norms summed in their GEMV's weights' loop), the
        residual adds and SiLU * up as their epilogues; q/k/v stay the compiled stage's (cuBLAS
        was the faster there at Qwen3.5-27B's widths). The rest of each stage is compiled apart
        (`GEMV_STAGES`). Same math as `_run` but for the sums' order and SiLU * up rounded as
        torch's eager ops round it."""
        from layersplit.shards.kernels.gemv import gemv

        lin_conv, lin_gate, att_gate, in_norm = self.gemv_stages
        rows = self._row_kernels_take()  # (`ROW_KERNELS_SWITCH`: no compiled stage)
        if rows:
            lin_conv, lin_gate, att_gate = ROW_KERNEL_STAGES
        eps = layer.input_layernorm.eps
        ln_w, ln2_w = layer.zc_weights
        mlp = layer.mlp
        dense = getattr(mlp, "gate_up_proj", None)
        advance = None
        if layer.linear:
            a = layer.linear_attn
            conv_state, state = kv.conv[index, slot:slot + 1], kv.state[index, slot:slot + 1]
            if self.one_pass:
                p = gemv(h, a.in_proj.weight, norm=(ln_w, eps), float_product=True,
                         one_pass=True, cfg=plain_launch(h.shape[1]))
            else:  # (the norm apart: `ONE_PASS_SWITCH`'s comment says why)
                normed = row_kernel_norm(h, ln_w, eps) if rows else \
                    in_norm(h, layer.input_layernorm.weight, eps)
                p = gemv(normed, a.in_proj.weight, cfg=plain_launch(h.shape[1]))
            q, k, v, g, beta, z, new_conv = lin_conv(
                p, a.conv1d.weight.squeeze(1), conv_state, a.A_log, a.dt_bias, a.conv_dim,
                a.key_dim, a.value_dim, a.num_k_heads, a.num_v_heads, a.head_k_dim,
                a.head_v_dim)
            ruled = (self._rows_rule(q, k, v, g, beta, state)  # (`STATE_IN_PLACE_SWITCH`)
                     if self._rows_kernel_takes(h) else None)
            if ruled is None:
                ruled = pick_rule(h.device, True, recurrent_gated_delta_rule)(
                    q, k, v, g, beta, state)
            o, new_state = ruled
            o = lin_gate(o, z, a.norm.weight, a.norm.eps)
            h = gemv(o, a.out_proj.weight, residual=h, cfg=plain_launch(o.shape[1]))
            advance = (conv_state, state, new_conv, new_state)
        else:
            a = layer.self_attn
            q, k, v, gate = self._attn_pre(layer, h, cos, sin, eps, rows)
            keys, values = kv.append(index, slot, step, k, v)  # (T, G, D) each
            out = attend(q, keys, values, step.mask, False)
            out = att_gate(out, gate)
            h = gemv(out, a.o_proj.weight, residual=h, cfg=plain_launch(out.shape[1]))
        if dense is not None:
            act = gemv(h, dense.weight, norm=(ln2_w, eps), float_product=True, gate_up=True,
                       one_pass=self.one_pass)
            h = gemv(act, mlp.down_proj.weight, residual=h, cfg=plain_launch(act.shape[1]))
        else:  # a sparse MLP, eager
            h = h + mlp(layer.post_attention_layernorm(h))
        if advance is not None:  # (last, as `_run`'s)
            conv_state, state, new_conv, new_state = advance
            conv_state.copy_(new_conv)
            if new_state is not None:  # (None: advanced in place)
                state.copy_(new_state)
        return h

    def _rows_kernel_takes(self, h: torch.Tensor) -> bool:
        """Whether a step's delta rule is the rows kernel (`_rows_rule`): switched on, where the
        Triton kernels run, and it has not failed."""
        return self.state_in_place and fused_kernels_available(h.device) and \
            not kernel_failed(ROWS_KERNEL)

    def _rows_rule(self, q, k, v, g, beta, states: torch.Tensor,
                   slots: torch.Tensor | None = None):
        """The delta rule through the rows kernel, over one row's state `states` (1, Hv, Dk,
        Dv), or with `slots` (a batched step) over a layer's pool of them (S, Hv, Dk, Dv), each
        row reading its slot's: (out, None) with the states advanced in place inside a capture,
        else (out, the new states (B, Hv, Dk, Dv)) for the caller to write back last
        (`STATE_IN_PLACE_SWITCH` says why); None where the kernel failed outside a capture
        (then off under its own name, `ROWS_KERNEL`, not the GEMV kernels': fla's rule
        answers)."""
        from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

        if self._advances_in_place():
            into = states if slots is not None else states.unsqueeze(1)
            return recurrent_rows(q, k, v, g, beta, states, into, slots), None
        into = torch.empty((q.shape[0], 1, *states.shape[1:]), dtype=torch.float32,
                           device=states.device)
        try:
            return recurrent_rows(q, k, v, g, beta, states, into, slots), into[:, 0]
        except (torch.cuda.OutOfMemoryError, IndexError):
            raise
        except Exception as e:  # noqa: BLE001 - the kernel off; fla's rule instead
            note_kernel_failure(ROWS_KERNEL, e)
            return None

    def _slots_rule(self, q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor):
        """A batched step's delta rule, each row reading its slot's state in `pool` (one
        layer's (S, Hv, Dk, Dv)): `_rows_rule`'s, or where its kernel failed fla's rule over
        the gathered states (out, the new states)."""
        ruled = self._rows_rule(q, k, v, g, beta, pool, slots)
        if ruled is not None:
            return ruled
        rule = pick_rule(pool.device, True, recurrent_gated_delta_rule)
        return rule(q, k, v, g, beta, pool.index_select(0, slots))

    def _advances_in_place(self) -> bool:
        """Whether this GEMV step advances the recurrent state in place: switched on, and
        inside a CUDA graph's capture (`STATE_IN_PLACE_SWITCH` says why only there)."""
        return self.state_in_place and torch.cuda.is_available() and \
            torch.cuda.is_current_stream_capturing()


def zc_scales(*norms) -> tuple[torch.Tensor, ...]:
    """Zero-centred norms' scales, 1 + w in float32, one per norm (the GEMV prologue's and the
    row kernels' `float_product` weight: `zc_norm`'s product, the same rounding)."""
    return tuple((1.0 + n.weight.detach().float()).contiguous() for n in norms)


def zc_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A hybrid layer's input and post-attention zero-centred norms' scales (`zc_scales`)."""
    return zc_scales(layer.input_layernorm, layer.post_attention_layernorm)


def fused_hybrid_switched_off() -> bool:
    return switched_off(ENV_SWITCH)


def fuses(cfg) -> bool:
    """Whether `fuse_hybrid` fuses a hybrid model of config `cfg` (on a GPU)."""
    return not fused_hybrid_switched_off() and cfg.hidden_act == "silu"


def fuse_hybrid(model, compile: bool = True) -> bool:
    """Fuse the projections of every layer of a hybrid range and install the fused one-token
    step; False (nothing changed) where switched off or the MLP's activation is not SiLU."""
    if not fuses(model.cfg):
        if fused_hybrid_switched_off():
            log.info("%s=0: hybrid decode steps run unfused", ENV_SWITCH)
        else:
            log.warning("hybrid layers with hidden_act=%s run unfused (the fused step is "
                        "SwiGLU)", model.cfg.hidden_act)
        return False
    fast = HybridFast(compile)
    for layer in model.layers:
        (layer.linear_attn if layer.linear else layer.self_attn).fuse()
        layer.mlp.fuse()
        layer.fast = fast
        scales = fast.gemv or fast.row_kernels  # (the float32 1 + w their norms take)
        layer.zc_weights = zc_weights(layer) if scales else None
        layer.qk_zc_weights = (zc_scales(layer.self_attn.q_norm, layer.self_attn.k_norm)
                               if fast.row_kernels and not layer.linear else None)
    if not fast.gemv:
        log.info("%s=0: one-row hybrid steps take the stages' cuBLAS GEMMs", GEMV_SWITCH)
    return True
