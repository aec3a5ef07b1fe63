"""The quantized GEMVs' operand checks (`shards.kernels.gemv_operands`), on a CPU: each bad
operand named, a good `out` kept, a missing one made; launch shapes: a bad one named (by the
GEMVs too, before any launch), every `launch_config` shape good, and FP8's narrowing of a
program's rows to a scale block's ending at 1 at the least."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.kernels import fp8_gemv, int4_gemv
from layersplit.shards.kernels.gemv_operands import check_launch, checked_out

X = torch.zeros(3, 8)


@pytest.mark.parametrize("kw, named", [
    ({"bias": torch.zeros(5)}, "f: bias (5,) is not a contiguous vector of 4"),
    ({"residual": torch.zeros(2, 4)}, "f: residual (2, 4) is not 3 rows of 4"),
    ({"norm": (torch.zeros(7), 1e-5)}, "f: norm weight (7,) is not a contiguous vector of 8"),
    ({"out": torch.zeros(3, 4).t()}, "f: out (4, 3) is not 3 rows of 4"),
])
def test_a_bad_operand_is_named(kw, named):
    args = {"bias": None, "residual": None, "norm": None, "out": None, **kw}
    with pytest.raises(ValueError) as e:
        checked_out("f", X, 4, 8, args["bias"], args["residual"], args["norm"], args["out"],
                    None)
    assert str(e.value) == named


def test_out_kept_or_made():
    wide = torch.zeros(3, 10)
    out = wide[:, 2:6]  # (rows strided: a slice of a wider result)
    assert checked_out("f", X, 4, 8, torch.zeros(4), torch.zeros(3, 4), (torch.ones(8), 1e-5),
                       out, None) is out
    made = checked_out("f", X.bfloat16(), 4, 8, None, None, None, None, torch.float32)
    assert made.shape == (3, 4) and made.dtype == torch.float32


@pytest.mark.parametrize("block_n, block_k, named", [
    (0, 64, "BLOCK_N=0"), (-4, 64, "BLOCK_N=-4"), (6, 64, "BLOCK_N=6"), (4, 96, "BLOCK_K=96"),
    (True, 64, "BLOCK_N=True"), (4.0, 64, "BLOCK_N=4.0")])
def test_a_bad_launch_shape_is_named(block_n, block_k, named):
    with pytest.raises(ValueError, match=f"^f: launch shape {named} is not a power of two$"):
        check_launch("f", block_n, block_k)


@pytest.mark.parametrize("module", [fp8_gemv, int4_gemv])
def test_launch_configs_are_good_shapes(module):
    for n in (8, 576, 4096, 6144, 14336, 28672):
        for k in (64, 4096, 14336):
            for gate_up in (False, True):
                kws = [{}, {"gathered": True}] if module is int4_gemv else [{}]
                for kw in kws:
                    c = module.launch_config(n, k, gate_up=gate_up, **kw)
                    check_launch(module.__name__, c["BLOCK_N"], c["BLOCK_K"])
                    assert c["BLOCK_K"] % 8 == 0 and c["num_warps"] in (1, 2, 4, 8)


def test_fp8_rows_per_program_ends():
    """Halved until it divides the scale block's rows: 1 at the least for odd blocks; a block
    or a program of no rows refused rather than dividing by zero or looping."""
    rows = fp8_gemv._rows_per_program
    assert rows(4, 128) == 4 and rows(32, 128) == 32 and rows(16, 24) == 8
    assert rows(32, 3) == 1 and rows(8, 1) == 1 and rows(6, 128) == 1
    for block_n, scale_rows in ((0, 128), (-4, 128), (4, 0), (4, -128)):
        with pytest.raises(ValueError, match="rows a program over scale blocks of"):
            rows(block_n, scale_rows)


def test_quantized_gemvs_refuse_a_bad_launch_shape_before_launching():
    from layersplit.shards.int4 import quantize_int4

    x = torch.zeros(1, 64)
    w8 = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_gemv: launch shape BLOCK_N=0"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (16, 32), cfg={"BLOCK_N": 0})
    with pytest.raises(ValueError, match="fp8_gemv: launch shape BLOCK_K=48"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (16, 32), cfg={"BLOCK_N": 4, "BLOCK_K": 48})
    with pytest.raises(ValueError, match=r"fp8_gemv: scale blocks of \(0, 32\)"):
        fp8_gemv.fp8_gemv(x, w8, torch.ones(2, 2), (0, 32))
    w4 = quantize_int4(torch.randn(32, 64), 32)
    with pytest.raises(ValueError, match="int4_gemv: launch shape BLOCK_N=3"):
        int4_gemv.int4_gemv(x, w4.qweight, w4.zeros, w4.scales, w4.group,
                            cfg={"BLOCK_N": 3, "BLOCK_K": 64})
