"""torch.compile made at a function's first call (`shards.fused`, `shards.fused_hybrid`)."""

from __future__ import annotations

import torch


def compiled_on_first_call(f):
    """`torch.compile(f)` made at the first call: building it imports torch.compile's modules
    (5-8 s of a start on an H100), which a dense model on the Triton kernels never needs."""
    compiled = None

    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(f, fullgraph=True, dynamic=False)
        return compiled(*args)

    return call
