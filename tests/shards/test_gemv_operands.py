"""The quantized GEMVs' operand checks (`shards.kernels.gemv_operands`), on a CPU: each bad
operand named, a good `out` kept, a missing one made; a launch shape not a power of two named
(the GEMVs' own shapes and refusals: `tests/gpu/test_gemv_launch.py`, where Triton is)."""

from __future__ import annotations

import pytest
import torch
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
