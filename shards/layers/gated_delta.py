"""The Gated DeltaNet block of the hybrid Qwen models (Qwen3.5, Qwen3-Next): exact torch.

A linear-attention layer keeps, per sequence, two pieces of state instead of a KV cache:
- the conv state: the last K - 1 inputs of the short causal depthwise convolution (K =
  `linear_conv_kernel_dim`), (B, C, K - 1) with C = 2 * key_dim + value_dim;
- the recurrent state: one (Dk, Dv) matrix per value head, (B, Hv, Dk, Dv), always float32.
A zero state is the state of an empty prefix, so a fresh sequence starts from zeros.

The delta rule runs in two forms with the same math: chunked (prefill: a few matmuls per chunk
of `chunk_size` tokens) and recurrent (decode: one token at a time). The torch functions here
are the reference; on CUDA, fla-core's kernels run them where installed
(`shards.kernels.gated_delta_fla`). The recurrent form can
also return the state after every row (`keep_states`), which a speculative verify step needs to
keep the state of exactly the accepted prefix.

Shapes: B = sequences, n = tokens per sequence, Hk / Hv = key / value heads, Dk / Dv = their
head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.kernels.gated_delta_fla import guarded, pick_conv, pick_rule
from layersplit.shards.layers.fused_linear import frozen_linear
from torch import nn

CHUNK_SIZE = 64  # the chunk of the chunked delta rule (as transformers and fla use)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (as fla and transformers compute it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor,  # (B, n, C)
    state: torch.Tensor,  # (B, C, K - 1): the last K - 1 inputs before x
    weight: torch.Tensor,  # (C, K)
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(depthwise causal conv) of x seen after `state`; returns (out (B, n, C), the new
    state (B, C, K - 1): the last K - 1 inputs including x)."""
    n = x.shape[1]
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, K - 1 + n)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    new_state = full[:, :, n:]
    return F.silu(out).transpose(1, 2).to(x.dtype), new_state


def conv_states_per_row(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The conv state after each of the n rows of x: (B, n, C, K - 1) (a verify step's)."""
    width = state.shape[-1]
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, K - 1 + n)
    return full.unfold(-1, width, 1)[:, :, 1:].permute(0, 2, 1, 3)  # windows ending at row j


def _prepare(q, k, v, g, beta):
    """fp32, heads-first ((B, H, n, D)), L2-normed q/k scaled q, k/q repeated per value head."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:  # each key head serves hv / hk consecutive value heads
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,  # (B, n, Hk, Dk)
    k: torch.Tensor,  # (B, n, Hk, Dk)
    v: torch.Tensor,  # (B, n, Hv, Dv)
    g: torch.Tensor,  # (B, n, Hv): log decay, <= 0
    beta: torch.Tensor,  # (B, n, Hv): write strength in (0, 1)
    state: torch.Tensor,  # (B, Hv, Dk, Dv) float32
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens in chunks (the WY/UT form); returns (out (B, n, Hv,
    Dv) in v's dtype, the final state). Chunks start at the step's first token."""
    dtype, n = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    b, h, total, dk = k.shape
    c = chunk_size
    q, k, v = (t.reshape(b, h, total // c, c, t.shape[-1]) for t in (q, k, v))
    beta, g = beta.reshape(b, h, -1, c), g.reshape(b, h, -1, c)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # (B, H, chunks, c): log decay from the chunk start to row i
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # (I + strictly-lower(diag(beta) K K^T * decay)) is the UT system of the chunk's updates
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, causal with decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.float()
    out = torch.empty_like(v)
    for i in range(total // c):
        v_new = values[:, :, i] - k_cum[:, :, i] @ s
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, total, -1)[:, :, :n].transpose(1, 2)
    return out.to(dtype), s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (shapes as `chunk_gated_delta_rule`). Returns
    (out, the final state (B, Hv, Dk, Dv)), or with `keep_states` (out, the state after every
    row (B, n, Hv, Dk, Dv))."""
    dtype, n = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float()
    out = torch.empty_like(v)
    kept = []
    for t in range(n):
        s = s * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]  # (B, H, Dk)
        delta = (v[:, :, t] - (s * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        s = s + k_t[..., None] * delta[..., None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(-2)
        if keep_states:
            kept.append(s)
    out = out.transpose(1, 2).to(dtype)
    return out, (torch.stack(kept, dim=1) if keep_states else s)


def _torch_rows(q, k, v, g, beta, state, states):
    """`recurrent_rows`' signature on the torch reference (the CPU's rule)."""
    out, rows = recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_states=True)
    states.copy_(rows)
    return out


_rows_failed: list[str] = []  # why the Triton rows kernel failed: the torch rule runs since


def keep_rows_rule(device: torch.device | str):
    """The rule of a verify step's rows that keeps each row's state, `(q, k, v, g, beta,
    state, states) -> out` (`shards.kernels.gated_delta_rows.recurrent_rows`): the Triton
    kernel where the Triton kernels run (`fused_kernels_available`), else the torch reference;
    a failing kernel call is logged and answered by the torch rule, from then on."""
    from layersplit.shards.kernels import fused_kernels_available

    if _rows_failed or not fused_kernels_available(device):
        return _torch_rows
    from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

    return guarded(recurrent_rows, _torch_rows, "the gated delta rule's verify-rows kernel",
                   _rows_failed)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, then times SiLU(gate) (the delta block's output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. `fused_projections` picks the checkpoint layout:
    Qwen3-Next's `in_proj_qkvz` + `in_proj_ba` (grouped per key head) or Qwen3.5's
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        fused_projections: bool,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim,
                                          bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        # the checkpoint's (C, 1, K) conv weight, as nn.Conv1d stores it
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj: nn.Linear | None = None  # every in-projection in one, set by `fuse` (GPU)

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def in_proj_weight(self) -> torch.Tensor:
        """The in-projections' weights as one, its rows in the order `project` returns them:
        mixed q/k/v (C), z (Hv * Dv), b (Hv), a (Hv). Qwen3-Next's rows are grouped per key
        head in the checkpoint; they are regrouped here, once."""
        if not self.fused_projections:
            return torch.cat([self.in_proj_qkv.weight, self.in_proj_z.weight,
                              self.in_proj_b.weight, self.in_proj_a.weight])
        hk, r = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        hid = self.in_proj_qkvz.weight.shape[1]
        q, k, v, z = self.in_proj_qkvz.weight.view(hk, 2 * dk + 2 * r * dv, hid).split(
            [dk, dk, r * dv, r * dv], dim=1)
        b, a = self.in_proj_ba.weight.view(hk, 2 * r, hid).split([r, r], dim=1)
        return torch.cat([t.reshape(-1, hid) for t in (q, k, v, z, b, a)])

    def fuse(self) -> None:
        """One in-projection (`in_proj_weight`) instead of two or four: one GEMV a decode step
        (the GPU path, `shards.fused_hybrid`). The separate weights are freed; a second call
        changes nothing."""
        if self.in_proj is not None:
            return
        self.in_proj = frozen_linear(self.in_proj_weight())
        for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
                     "in_proj_a"):
            if hasattr(self, name):
                delattr(self, name)

    def split_projection(self, p: torch.Tensor):
        """`in_proj`'s output (B, n, C + Hv * Dv + 2 Hv) as `project` returns it."""
        bsz, n = p.shape[:2]
        mixed, z, b, a = p.split([self.conv_dim, self.value_dim, self.num_v_heads,
                                  self.num_v_heads], dim=-1)
        return mixed, z.reshape(bsz, n, self.num_v_heads, self.head_v_dim), b, a

    def project(self, x: torch.Tensor):
        """(B, n, hidden) -> mixed q/k/v (B, n, C), z (B, n, Hv, Dv), b and a (B, n, Hv)."""
        bsz, n = x.shape[:2]
        if self.in_proj is not None:
            return self.split_projection(self.in_proj(x))
        if not self.fused_projections:
            z = self.in_proj_z(x).view(bsz, n, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        hk, r = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(bsz, n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, n, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(bsz, n, -1), k.reshape(bsz, n, -1),
                           v.reshape(bsz, n, -1)], dim=-1)
        z = z.reshape(bsz, n, self.num_v_heads, dv)
        return mixed, z, b.reshape(bsz, n, -1), a.reshape(bsz, n, -1)

    def forward(
        self,
        x: torch.Tensor,  # (B, n, hidden)
        conv_state: torch.Tensor,  # (B, C, K - 1), updated in place
        state: torch.Tensor,  # (B, Hv, Dk, Dv) float32, updated in place
        recurrent: bool | None = None,
        keep_states: bool = False,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Returns (out (B, n, hidden), kept): with `keep_states` (recurrent form), kept is the
        conv and recurrent state after every row, (B, n, C, K - 1) and (B, n, Hv, Dk, Dv)
        (written into `into` where given: float32 and contiguous for the states), and the
        states passed in are left as they were (the caller keeps the accepted row's); else
        None and the states are advanced past the n tokens. `recurrent` defaults to the
        recurrent form for one token, the chunked form for more."""
        bsz, n = x.shape[:2]
        if recurrent is None:
            recurrent = n == 1
        mixed, z, b, a = self.project(x)
        conv = causal_conv if recurrent or keep_states else pick_conv(x.device, causal_conv)
        conv_out, new_conv = conv(mixed, conv_state, self.conv1d.weight.squeeze(1))
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(bsz, n, self.num_k_heads, self.head_k_dim)
        k = k.reshape(bsz, n, self.num_k_heads, self.head_k_dim)
        v = v.reshape(bsz, n, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        kept = None
        if keep_states:
            conv_rows = conv_states_per_row(mixed, conv_state)
            if into is None:
                into = (conv_rows, torch.empty((bsz, n, *state.shape[1:]), dtype=torch.float32,
                                               device=state.device))
            else:
                into[0].copy_(conv_rows)
            out = keep_rows_rule(x.device)(q, k, v, g, beta, state, into[1])
            kept = into
        else:
            rule = pick_rule(x.device, recurrent,  # fla-core's on CUDA where installed
                             recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule)
            out, new_state = rule(q, k, v, g, beta, state)
            conv_state.copy_(new_conv)
            state.copy_(new_state)
        out = self.norm(out, z)  # (B, n, Hv, Dv)
        return self.out_proj(out.reshape(bsz, n, self.value_dim)), kept
