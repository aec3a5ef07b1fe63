"""Hand-written GPU kernels (Triton) for the decode step, and when they may run.

Triton is never imported on a CPU-only install: `fused_kernels_available` answers False there
(unless `TRITON_INTERPRET=1`, Triton's CPU interpreter, set to develop and check the kernels
without a GPU). `LAYERSPLIT_FUSED_KERNELS=0` switches them off, so the compiled torch path of
`shards.fused` runs instead (the reference the GPU tests compare the kernels with).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from layersplit.shards.switches import switched_off, switched_on  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

ENV_SWITCH = "LAYERSPLIT_FUSED_KERNELS"
# the one-row GEMV kernels (`gemv`), on where the other kernels are; 0 switches them alone off
GEMV_SWITCH = "LAYERSPLIT_GEMV_KERNELS"


# the most rows of a step that take them: 1 (batch-1 decode, measured) unless set higher, up to
# `gemv.MAX_ROWS` (verify trees and small batches through the tensor cores: not measured yet)
GEMV_ROWS = "LAYERSPLIT_GEMV_ROWS"
GEMV_ROWS_MAX = 64


def gemv_kernels_available() -> bool:
    """Whether steps of few rows take the GEMV kernels where the decode kernels run."""
    return not switched_off(GEMV_SWITCH)


def gemv_max_rows() -> int:
    """The most rows of a step that take the GEMV kernels (`GEMV_ROWS`, default 1)."""
    raw = os.environ.get(GEMV_ROWS, "1").strip()
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= GEMV_ROWS_MAX:
        raise ValueError(f"{GEMV_ROWS}={raw!r}: the most rows of a step that take the GEMV "
                         f"kernels must be a whole number from 1 to {GEMV_ROWS_MAX}")
    return int(raw)


def fused_kernels_available(device: torch.device | str) -> bool:
    """Whether the Triton decode kernels run for tensors on `device`."""
    if switched_off(ENV_SWITCH):
        return False
    dev = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type != "cuda" and not (dev.type == "cpu" and interpret):
        return False
    if dev.type == "cuda" and torch.version.hip is not None:
        return False  # written and measured on NVIDIA only
    return importlib.util.find_spec("triton") is not None


def fp8_kernels_available(device: torch.device | str) -> bool:
    """Whether the FP8 GEMV (`kernels.fp8_gemv`) runs for tensors on `device`: the Triton
    kernels run there, and the GPU converts float8 e4m3 (compute capability 8.9 and later: Ada,
    Hopper; Triton refuses it below, where `layers.fp8_linear` dequantizes tiles instead)."""
    if not fused_kernels_available(device):
        return False
    dev = torch.device(device)
    return dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 9)


# programmatic dependent launch of the decode kernels (`kernels.pdl`): on where it runs; 0: off
PDL_SWITCH = "LAYERSPLIT_PDL"


@functools.lru_cache(maxsize=None)
def _device_pdl(index: int) -> bool:
    """Whether CUDA device `index` and this Triton launch kernels with PDL: NVIDIA, compute
    capability 9.0 or later (Hopper), Triton 3.3 or later (`launch_pdl`, `gdc_wait`)."""
    if torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode kernels on `device` launch with PDL (`kernels.pdl`): a CUDA device
    where it runs (`_device_pdl`), unless `LAYERSPLIT_PDL=0`."""
    if device.type != "cuda" or switched_off(PDL_SWITCH):
        return False
    return _device_pdl(torch.cuda.current_device() if device.index is None else device.index)


_FAILED: set[str] = set()  # the kernels (by name) that failed once in this process


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message that says something (a Triton compile error's may start
    with an empty one), at most 200 characters; `repr(e)` where there is none."""
    return next((line for line in str(e).splitlines() if line.strip()), repr(e))[:200]


def kernel_failed(name: str) -> bool:
    """Whether kernel `name` failed once in this process (`try_kernel`): its torch path runs."""
    return name in _FAILED


def try_kernel(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None where it raised (a Triton build or launch failure): kernel `name` is
    then off for the rest of the process (`kernel_failed`), said once in the log, and the caller
    runs its torch path. Out-of-memory and index errors are the step's own and propagate."""
    try:
        return fn(*args)
    except (torch.cuda.OutOfMemoryError, IndexError):
        raise
    except Exception as e:  # noqa: BLE001 - a failing kernel: its torch path runs
        note_kernel_failure(name, e)
        return None


def note_kernel_failure(name: str, e: BaseException) -> None:
    """Kernel `name` failed with `e`: off for the rest of the process (`kernel_failed`), said
    in the log (`try_kernel`'s handling, for callers that sort failures themselves)."""
    _FAILED.add(name)
    log.warning("the %s kernel failed (%s: %s); its torch path runs from now on", name,
                type(e).__name__, first_line(e))
