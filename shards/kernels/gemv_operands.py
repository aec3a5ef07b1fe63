"""The checks the GEMVs (`kernels.gemv`, `kernels.quant_gemv`, `kernels.fp8_gemv`,
`kernels.int4_gemv`) make on their rows and options, and the result they write: one place, so
that each names a bad operand alike."""

from __future__ import annotations

import torch


def check_rows(fn: str, x: torch.Tensor, most: int) -> None:
    """Raise ValueError, naming `fn`, unless `x` is 1 to `most` rows (M, K) of contiguous
    values."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= most or x.stride(1) != 1:
        raise ValueError(f"{fn}: x must be 1 to {most} rows (M, K) of contiguous values, got "
                         f"{tuple(x.shape)} strides {x.stride()}")


def checked_out(fn: str, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                residual: torch.Tensor | None, norm: tuple[torch.Tensor, float] | None,
                out: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """`out` (or a new (M, n) tensor of `out_dtype`, default x's) once `bias` (n,), `residual`
    (M, n), `norm`'s weight (k,) and `out` (M, n; rows may be strided) are what `fn` (its name,
    for the error) takes for rows `x` (M, k); raises ValueError naming the one that is not."""
    m = x.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"{fn}: bias {tuple(bias.shape)} is not a contiguous vector of {n}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"{fn}: residual {tuple(residual.shape)} is not {m} rows of {n}")
    if norm is not None and (norm[0].shape != (k,) or norm[0].stride(0) != 1):
        raise ValueError(f"{fn}: norm weight {tuple(norm[0].shape)} is not a contiguous vector "
                         f"of {k}")
    if out is None:
        return torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"{fn}: out {tuple(out.shape)} is not {m} rows of {n}")
    return out


def check_launch(fn: str, block_n: int, block_k: int) -> None:
    """Raise ValueError, naming `fn`, unless the launch shape's BLOCK_N and BLOCK_K are
    powers of two (Triton's blocks; a zero or negative one would not end `fp8_gemv`'s
    narrowing of BLOCK_N either)."""
    for name, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
            raise ValueError(f"{fn}: launch shape {name}={v!r} is not a power of two")


def shared_chunks(gate_up: torch.Tensor, down: torch.Tensor, width: int) -> int | None:
    """How many experts of width `width` a shared SwiGLU MLP of fused gate/up weight (2F, H)
    and down weight (H, F) makes (`run_gemv`'s `shared`): F / width, or None where F is no
    multiple of it, the shapes do not pair or the weights are not contiguous."""
    if gate_up.dim() != 2 or down.dim() != 2 or width <= 0:
        return None
    h, f = down.shape
    if f % width or gate_up.shape != (2 * f, h) or not (gate_up.is_contiguous() and
                                                         down.is_contiguous()):
        return None
    return f // width
