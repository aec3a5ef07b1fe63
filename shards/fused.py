"""The GPU decode step of a layer with its elementwise work fused by torch.compile.

A decode step of one layer is ~60 kernels in eager PyTorch (each RMSNorm alone is eight); inside
a CUDA graph each still costs ~2 us, several ms per token for a 36-layer model. Here the work
before attention (norm, fused q/k/v matmul, q/k norm, rotary) and after it (o_proj, residual,
norm, fused gate/up matmul, SiLU, down, residual) are two functions compiled once and shared by
every layer (weights are arguments, so one compilation serves all layers of a shape). Attention
stays eager (its key count changes with the graph bucket). Same math as `shards.models`; the GPU
tests compare the two. A mixture-of-experts layer's work after attention is `shards.fused_moe`.

Batched decode steps (`StepInfo.batched`) run the same two functions on their padded rows, but
compiled under code objects of their own: dynamo allows 8 compiled shapes per code object (with
fullgraph a 9th raises), and each batch bucket is a shape, so sharing would starve the
single-sequence and verify steps.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shards.fused_moe import moe_args, post_attention_moe, post_attention_moe_batch
from shards.layers.attention import group_queries

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


def pre_attention_batch(*args):
    """`pre_attention` under its own code object, for batched steps (see the module doc)."""
    return pre_attention(*args)


def post_attention_batch(*args):
    """`post_attention` under its own code object, for batched steps (see the module doc)."""
    return post_attention(*args)


class _Stages:
    """The functions before and after attention for one kind of step, compiled or eager."""

    def __init__(self, pre, post, post_moe, compile: bool) -> None:
        self.pre, self.post, self.post_moe, self.compiled = pre, post, post_moe, compile
        if compile:
            self.pre = torch.compile(pre, fullgraph=True, dynamic=False)
            self.post = torch.compile(post, fullgraph=True, dynamic=False)
            self.post_moe = torch.compile(post_moe, fullgraph=True, dynamic=False)

    def uncompile(self) -> None:
        self.pre, self.post, self.compiled = pre_attention, post_attention, False
        self.post_moe = post_attention_moe


class FusedDecode:
    """Callable installed as `DecoderLayer.fast` on every layer of a GPU range."""

    def __init__(self, compile: bool = True) -> None:
        self.single = _Stages(pre_attention, post_attention, post_attention_moe, compile)
        self.batched = _Stages(pre_attention_batch, post_attention_batch,
                               post_attention_moe_batch, compile)

    @property
    def compiled(self) -> bool:
        """Whether single-sequence steps run compiled (False after a compiler failure)."""
        return self.single.compiled

    def __call__(self, layer, h, cos, sin, kv, index, slot, step):
        stages = self.single if step.lo is None else self.batched
        try:
            return self._run(stages, layer, h, cos, sin, kv, index, slot, step)
        except Exception as e:
            if not stages.compiled or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            log.warning("torch.compile of the decode step failed (%s: %s); running it eager",
                        type(e).__name__, e)
            stages.uncompile()
            return self._run(stages, layer, h, cos, sin, kv, index, slot, step)

    @staticmethod
    def _run(stages: _Stages, layer, h, cos, sin, kv, index, slot, step):
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


def fuse_projections(model, compile: bool = True) -> None:
    """Fuse q/k/v and gate/up weights of every layer and install the fused decode step."""
    fast = FusedDecode(compile)
    for layer in model.layers:
        if not getattr(layer, "fusable", True):  # a layout of its own (Gemma): stays eager
            continue
        layer.self_attn.fuse()
        layer.mlp.fuse()
        layer.fast = fast
