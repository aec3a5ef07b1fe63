"""The GEMV over weights kept in FP8 (`shards.kernels.fp8_gemv`) against dequantize-then-matmul
(`shards.fp8.dequantize_fp8` in float32), for odd shapes, partial scale blocks and 1 to 16 rows,
with the norm prologue, SiLU * up and residual epilogues; and a whole tiny model on the device
kept in FP8 against the same checkpoint dequantized at load, the fused decode step included.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: products within 1e-5 (float32) or 1e-2 (bf16
activations, the output rounded once) of the result's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.fp8 import dequantize_fp8, quantize_fp8
from layersplit.shards.kernels import fused_kernels_available

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]


def _case(n: int, k: int, block: tuple[int, int], seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s = quantize_fp8(w, block)
    return q.to(DEV), s.to(DEV), dequantize_fp8(q, s, block, torch.float32).to(DEV)


# (rows, outputs, inputs, block): whole blocks of 128; partial blocks on both sides (DeepSeek's
# 576 rows of 128); blocks narrower than a chunk; 16 rows
CASES = [(1, 256, 512, (128, 128)), (3, 576, 384, (128, 128)), (2, 40, 70, (16, 32)),
         (16, 37, 96, (16, 32)), (1, 9, 1000, (128, 128))]


@pytest.mark.parametrize("rows,n,k,block", CASES)
def test_fp8_gemv_equals_dequantize_then_matmul(rows, n, k, block):
    from layersplit.shards.kernels.fp8_gemv import fp8_gemv

    w, s, ref = _case(n, k, block, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    want = F.linear(x, ref, bias)
    for cfg in (None, {"BLOCK_N": 1, "BLOCK_K": 32, "num_warps": 1}):
        got = fp8_gemv(x, w, s, block, bias, cfg=cfg)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    if DEV != "cpu":
        xb = x.bfloat16()
        got = fp8_gemv(xb, w, s, block).float()
        want = F.linear(xb.float(), ref)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_fp8_gemv_fused_options_equal_torch():
    """The norm prologue and SiLU * up (a gate/up weight whose halves are whole blocks), then a
    residual, against the torch ops they replace (float32)."""
    from layersplit.shards.fused import rms_norm
    from layersplit.shards.kernels.fp8_gemv import fp8_gemv

    block = (16, 32)
    w, s, ref = _case(2 * 48, 160, block, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 160, generator=gen).to(DEV)
    nw = (1 + 0.1 * torch.randn(160, generator=gen)).to(DEV)
    res = torch.randn(2, 48, generator=gen).to(DEV)
    g, u = F.linear(rms_norm(x, nw, 1e-5), ref).chunk(2, dim=-1)
    want = F.silu(g) * u
    got = fp8_gemv(x, w, s, block, norm=(nw, 1e-5), gate_up=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    want = res + F.linear(x, ref[:48])
    got = fp8_gemv(x, w[:48], s[:3], block, residual=res)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_fp8_gemv_refuses_bad_input():
    from layersplit.shards.kernels.fp8_gemv import fp8_gemv

    w, s, _ = _case(40, 64, (16, 32))
    x = torch.zeros(1, 64, device=DEV)
    with pytest.raises(ValueError, match="do not take a row of 64"):
        fp8_gemv(x, w, s[:, :1], (16, 32))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fp8_gemv(torch.zeros(17, 64, device=DEV), w, s, (16, 32))
    with pytest.raises(ValueError, match="halves of whole scale blocks"):
        fp8_gemv(x, w, s, (16, 32), gate_up=True)  # (40 rows: halves of 20)


@pytest.mark.skipif(DEV == "cpu", reason="minutes under the interpreter: a device run's test")
@pytest.mark.parametrize("fuse", [False, True])
def test_model_on_device_kept_fp8_equals_dequantized(tmp_path, fuse):
    """A tiny Llama as an FP8 checkpoint on the device, float32: kept in FP8 (decode steps: the
    GEMV; prefill: tiles dequantized; `fuse`: the fused decode step, its norms and residual adds
    folded into the FP8 GEMV) against the same checkpoint dequantized at load, split
    differently."""
    from layersplit.shards.tiny import write_tiny_checkpoint

    from tests.helpers import write_fp8
    from tests.shards.test_quant_linear import _logits

    fp8 = write_fp8(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=3),
                    tmp_path / "fp8")
    want = _logits(fp8, "dequantize", [(0, 3)], DEV)
    got = _logits(fp8, "quantized", [(0, 1), (1, 3)], DEV, fuse=fuse)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
