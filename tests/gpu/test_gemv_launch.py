"""The quantized GEMVs' launch shapes (`fp8_gemv`, `int4_gemv`, the planar K-quant one of
`quant_gemv`; their modules import Triton):
every `launch_config` shape good, FP8's narrowing of a program's rows to a scale block's ending
at 1 at the least, and a bad shape refused before any launch."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.kernels.gemv_operands import check_launch

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

pytestmark = pytest.mark.gpu


def _kernels():
    """The two GEMV modules (imported here: they need Triton, which CPU CI has not)."""
    from layersplit.shards.kernels import fp8_gemv, int4_gemv

    return fp8_gemv, int4_gemv


@pytest.mark.parametrize("which", [0, 1])
def test_launch_configs_are_good_shapes(which):
    module = _kernels()[which]
    int4_gemv = _kernels()[1]
    for n in (8, 576, 4096, 6144, 14336, 28672):
        for k in (64, 4096, 14336):
            for gate_up in (False, True):
                kws = [{}, {"gathered": True}] if module is int4_gemv else [{}]
                for kw in kws:
                    c = module.launch_config(n, k, gate_up=gate_up, **kw)
                    check_launch(module.__name__, c["BLOCK_N"], c["BLOCK_K"])
                    assert c["BLOCK_K"] % 8 == 0 and c["num_warps"] in (1, 2, 4, 8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_planar_launch_configs_are_good_shapes(qtype):
    from layersplit.shards.kernels.quant_gemv import planar_launch_config

    for n in (8, 576, 4096, 6144, 14336, 28672):
        for k in (256, 4096, 14336):
            plain = planar_launch_config(2 * n, k, qtype)
            c = planar_launch_config(n, k, qtype, gate_up=True)
            assert c == plain  # (the gate/up epilogue's sums: those of the GEMV then SiLU)
            check_launch("quant_gemv", c["BLOCK_N"], c["BLOCK_K"])
            assert c["BLOCK_K"] >= 32 and c["num_warps"] in (1, 2, 4, 8)


def test_fp8_rows_per_program_ends():
    """Halved until it divides the scale block's rows: 1 at the least for odd blocks; a block
    or a program of no rows refused rather than dividing by zero or looping."""
    rows = _kernels()[0]._rows_per_program
    assert rows(4, 128) == 4 and rows(32, 128) == 32 and rows(16, 24) == 8
    assert rows(32, 3) == 1 and rows(8, 1) == 1 and rows(6, 128) == 1
    for block_n, scale_rows in ((0, 128), (-4, 128), (4, 0), (4, -128)):
        with pytest.raises(ValueError, match="rows a program over scale blocks of"):
            rows(block_n, scale_rows)


def test_quantized_gemvs_refuse_a_bad_launch_shape_before_launching():
    from layersplit.shards.int4 import quantize_int4

    fp8_gemv, int4_gemv = _kernels()

    x = torch.zeros(1, 64)
    w8 = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_gemv: launch shape BLOCK_N=0"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (16, 32), cfg={"BLOCK_N": 0})
    with pytest.raises(ValueError, match="fp8_gemv: launch shape BLOCK_K=48"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (16, 32), cfg={"BLOCK_N": 4, "BLOCK_K": 48})
    with pytest.raises(ValueError, match=r"fp8_gemv: scale blocks of \(0, 32\)"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (0, 32))
    w4 = quantize_int4(torch.randn(32, 64), 32)
    from layersplit.shards.kernels.quant_gemv import quant_gemv
    from layersplit.shards.quant_blocks import to_planar

    flat = to_planar(torch.zeros(32, 144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="quant_gemv: launch shape BLOCK_K=96"):
        quant_gemv(torch.zeros(1, 256), flat, "Q4_K", planar=True,
                   cfg={"BLOCK_N": 8, "BLOCK_K": 96})
    with pytest.raises(ValueError, match="int4_gemv: launch shape BLOCK_N=3"):
        int4_gemv.int4_gemv(x, w4.qweight, w4.zeros, w4.scales, w4.group,
                            cfg={"BLOCK_N": 3, "BLOCK_K": 64})
