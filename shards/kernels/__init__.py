"""Hand-written GPU kernels (Triton) for the decode step, and when they may run.

Triton is never imported on a CPU-only install: `fused_kernels_available` answers False there
(unless `TRITON_INTERPRET=1`, Triton's CPU interpreter, set to develop and check the kernels
without a GPU). `LAYERSPLIT_FUSED_KERNELS=0` switches them off, so the compiled torch path of
`shards.fused` runs instead (the reference the GPU tests compare the kernels with).
"""

from __future__ import annotations

import importlib.util
import os

import torch

ENV_SWITCH = "LAYERSPLIT_FUSED_KERNELS"
# the one-row GEMV kernels (`gemv`), on where the other kernels are; 0 switches them alone off
GEMV_SWITCH = "LAYERSPLIT_GEMV_KERNELS"


def _off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def gemv_kernels_available() -> bool:
    """Whether one-row steps take the GEMV kernels where the decode kernels run."""
    return not _off(GEMV_SWITCH)


def fused_kernels_available(device: torch.device | str) -> bool:
    """Whether the Triton decode kernels run for tensors on `device`."""
    if _off(ENV_SWITCH):
        return False
    dev = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type != "cuda" and not (dev.type == "cpu" and interpret):
        return False
    if dev.type == "cuda" and torch.version.hip is not None:
        return False  # written and measured on NVIDIA only
    return importlib.util.find_spec("triton") is not None
