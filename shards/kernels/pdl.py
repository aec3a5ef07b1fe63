"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

Inside a captured decode step each kernel is short (2-10 us) and, launched the plain way,
starts only once the kernel before it has drained: its launch and its first wave's start are
paid in full, hundreds of times a step. Launched with PDL, a kernel's programs may be placed on
the GPU while the kernel before it still runs; they wait (`griddepcontrol.wait`) until that
kernel has finished and its writes are visible, then go on. So every kernel launched this way
calls `pdl_start` first, in every program, before it reads or writes any memory: it reads
nothing early, overwrites nothing the kernel before it still reads, and cannot finish before
its predecessor has, so the chain stays ordered for every later kernel (each waits on the one
before it, which waited on its own; `tests/shards/test_pdl.py` checks each kernel's first
statement and each launch). It calls `griddepcontrol.launch_dependents` after its wait, so at
most the next kernel is placed early. Kernels launched the plain way (torch's, cuBLAS's) keep
their full ordering on both sides.

Measured on an H200 (`bench/pdl_chain.py`, `bench/RESULTS.md`): 0.2-0.3 us a kernel; Llama-8B
shape decode 1.02 x, DeepSeek-V2-Lite width 1.026 x. Reading the first block of a GEMV's
weights before the wait, and each later one a block ahead, was slower (0.96 x) and is not done.

`pdl(t)` gives a launch's keyword arguments: the kernel's `PDL` constexpr and Triton's
`launch_pdl` where `kernels.pdl_enabled` says so for t's device, none elsewhere (the CPU
interpreter, ROCm, GPUs before Hopper, `LAYERSPLIT_PDL=0`), where the kernels run as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels import pdl_enabled

try:  # (Triton 3.3 and later; `pdl_enabled` answers no without them)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it (see the module)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl(t: torch.Tensor) -> dict:
    """The PDL keyword arguments of a launch whose tensors are on t's device (see the module):
    read-only, to be unpacked into the launch."""
    return _ON if pdl_enabled(t.device) else _OFF
