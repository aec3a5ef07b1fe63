"""The GEMV over weights kept in int4 (`shards.kernels.int4_gemv`) against dequantize-then-matmul
(`shards.int4.dequantize_packed` in float32), for odd shapes, groups of 128, one group (-1) and
small ones, chunks of inputs spanning several groups (of 32, 64, 96, 128) and ending past K, act
order's permuted groups, 1 to 16 rows, with the norm prologue, SiLU * up and residual
epilogues; and a whole tiny model on the device kept in int4 against the same checkpoint
dequantized at load, the fused decode step included.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: products within 1e-5 (float32) or 1e-2 (bf16
activations, the output rounded once) of the result's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.int4 import Int4Weight, dequantize_packed, pack_rows
from layersplit.shards.kernels import fused_kernels_available

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]


def _case(n: int, k: int, group: int, act_order: bool = False, seed: int = 0):
    """A random int4 weight of `group` inputs a group (-1: one) in the kept layout, and its
    dequantized float32 values."""
    gen = torch.Generator().manual_seed(seed)
    rows = k if group == -1 else group
    g = k // rows
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 17, (n, g), generator=gen).to(torch.uint8)  # (GPTQ's 16 too)
    scales = (torch.rand(n, g, generator=gen) * 0.1 + 0.01).half().float()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // rows)[torch.randperm(k, generator=gen)].to(torch.int32)
    w = Int4Weight(pack_rows(q.t()).t().contiguous(), zeros, scales, g_idx, rows)
    w = Int4Weight(*(None if t is None else t.to(DEV)
                     for t in (w.qweight, w.zeros, w.scales, w.g_idx)), rows)
    return w, dequantize_packed(w.qweight, w.zeros, w.scales, w.g_idx, rows, torch.float32)


def _gemv(x, w: Int4Weight, bias=None, **kw):
    from layersplit.shards.kernels.int4_gemv import int4_gemv

    return int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias, **kw)


# (rows, outputs, inputs, group, act order): groups of 128; one group of an odd K (sub-chunks of
# a word); small groups (8: a zero and a scale a word, 32); act order's permuted groups; 16 rows;
# a group of 96 (chunks of 32, three a group)
CASES = [(1, 256, 512, 128, False), (3, 40, 200, -1, False), (2, 24, 96, 8, False),
         (16, 40, 96, 32, False), (5, 48, 256, 64, True), (1, 8, 1024, -1, False),
         (2, 24, 384, 96, False)]


@pytest.mark.parametrize("rows,n,k,group,act_order", CASES)
def test_int4_gemv_equals_dequantize_then_matmul(rows, n, k, group, act_order):
    w, ref = _case(n, k, group, act_order, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    want = F.linear(x, ref, bias)
    for cfg in (None, {"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 1},  # (several chunks a
                {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 2}):  # group; chunks past K)
        got = _gemv(x, w, bias, cfg=cfg)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    if DEV != "cpu":
        xb = x.bfloat16()
        got = _gemv(xb, w).float()
        want = F.linear(xb.float(), ref)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


# (group, inputs, act order, launch shape): chunks of 4 groups of 32; of 64 with the last chunk
# past K (448 = 256 + 192); one chunk of 1024 over 5 groups of 128; groups of 96 (sub-chunks of
# 32, chunks cut groups); act order's gathered groups in a chunk of 256; groups of 4 and of 12
# (half a word, a word and a half: each value's zero and scale gathered)
SPAN = [(32, 384, False, {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 2}),
        (64, 448, False, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 2}),
        (128, 640, False, {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4}),
        (96, 480, False, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 8}),
        (64, 256, True, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2}),
        (4, 64, False, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1}),
        (12, 96, False, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 1})]


@pytest.mark.parametrize("group,k,act_order,cfg", SPAN)
def test_int4_gemv_chunks_span_groups(group, k, act_order, cfg):
    """Chunks of several groups, each group's own zero and scale (random per group: a chunk
    that took one group's for another's would be off by far more than the tolerance)."""
    w, ref = _case(24, k, group, act_order, seed=group)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)).to(DEV)
    want = F.linear(x, ref)
    got = _gemv(x, w, cfg=cfg)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# (group, inputs, act order, launch shape): the gate/up step's own shape (chunks of 256 past K);
# act order; chunks of 2 groups of 64 on 8 rows a program
FUSED = [(32, 160, False, None), (32, 160, True, None),
         (64, 384, False, {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 2})]


@pytest.mark.parametrize("group,k,act_order,cfg", FUSED)
def test_int4_gemv_fused_options_equal_torch(group, k, act_order, cfg):
    """The norm prologue and SiLU * up (a gate/up weight), then a residual, against the torch
    ops they replace (float32)."""
    from layersplit.shards.fused import rms_norm

    w, ref = _case(2 * 48, k, group, act_order, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, k, generator=gen).to(DEV)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEV)
    res = torch.randn(2, 48, generator=gen).to(DEV)
    g, u = F.linear(rms_norm(x, nw, 1e-5), ref).chunk(2, dim=-1)
    want = F.silu(g) * u
    got = _gemv(x, w, norm=(nw, 1e-5), gate_up=True, cfg=cfg)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    want = res + F.linear(x, ref[:48])
    half = Int4Weight(w.qweight[:48], w.zeros[:48], w.scales[:48], w.g_idx, w.group)
    got = _gemv(x, half, residual=res, cfg=cfg)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_int4_gemv_refuses_bad_input():
    w, _ = _case(40, 64, 16)
    x = torch.zeros(1, 64, device=DEV)
    with pytest.raises(ValueError, match="does not take a row of 64: zeros"):
        _gemv(x, Int4Weight(w.qweight, w.zeros[:, :1], w.scales, None, 16))
    with pytest.raises(ValueError, match="does not take a row of 72: int32 words"):
        _gemv(torch.zeros(1, 72, device=DEV), w)
    with pytest.raises(ValueError, match="4 groups of 8 inputs are not 64"):
        _gemv(x, Int4Weight(w.qweight, w.zeros, w.scales, None, 8))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        _gemv(torch.zeros(17, 64, device=DEV), w)
    with pytest.raises(ValueError, match="an even row count and no bias"):
        _gemv(x, w, torch.zeros(40, device=DEV), gate_up=True)
    with pytest.raises(ValueError, match="launch shape BLOCK_N=0 is not a power of two"):
        _gemv(x, w, cfg={"BLOCK_N": 0, "BLOCK_K": 64, "num_warps": 1})


@pytest.mark.parametrize("method,fuse", [("gptq", False), ("gptq", True), ("awq", True)])
def test_model_on_device_kept_int4_equals_dequantized(tmp_path, method, fuse):
    """A tiny Llama as a GPTQ (act order) or AWQ checkpoint on the device, float32: kept in int4
    (decode steps: the GEMV; prefill: tiles dequantized; `fuse`: the fused decode step, its
    norms and residual adds folded into the int4 GEMV, q/k/v and gate/up each one module)
    against the same checkpoint dequantized at load, split differently. (~15 s a case under
    the interpreter.)"""
    from layersplit.shards.tiny import write_tiny_checkpoint

    from tests.helpers import write_int4
    from tests.shards.test_quant_linear import _logits

    packed = write_int4(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=3),
                        tmp_path / method, method, act_order=method == "gptq")
    want = _logits(packed, "dequantize", [(0, 3)], DEV)
    if fuse:  # (the fused step takes every layer: its projections are the int4 GEMV's)
        from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
        from layersplit.shards.fused import fuse_projections

        r = load_layer_range(open_checkpoint(packed), 0, 3, torch.float32, DEV, "quantized")
        fuse_projections(r, compile=False)
        assert all(hasattr(layer, "fast") for layer in r.layers)
    got = _logits(packed, "quantized", [(0, 1), (1, 3)], DEV, fuse=fuse)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
