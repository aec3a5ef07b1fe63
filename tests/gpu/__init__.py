"""GPU tests (marker `gpu`): run on a CUDA machine with `python -m pytest -m gpu`."""

from __future__ import annotations

import torch


def near(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Whether `a` is within `tol` of `b` per unit of `b`'s largest magnitude (at least 1): the
    tiny test models' logits and rows reach ~10, where float32 and bf16 rounding grow with
    them."""
    a, b = a.float().cpu(), b.float().cpu()
    return bool((a - b).abs().max() < tol * max(1.0, b.abs().max().item()))


# the Triton kernels' tests: on a CUDA device, or on a CPU through Triton's interpreter
# (`TRITON_INTERPRET=1`, float32 only there)
KERNEL_DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float32] + ([torch.bfloat16] if KERNEL_DEV != "cpu" else [])


def kernel_marks() -> list:
    """`pytestmark` of a kernel test module: the gpu marker, and a skip where neither a CUDA
    device nor the interpreter runs the kernels."""
    import pytest
    from layersplit.shards.kernels import fused_kernels_available

    return [pytest.mark.gpu,
            pytest.mark.skipif(not fused_kernels_available(KERNEL_DEV),
                               reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
