"""`shards.cuda_context` on a CUDA machine: the context made ahead, in a fresh process before
torch is imported, is the one torch's runtime then makes current (the device's primary
context), and torch computes on it. Run on a CUDA machine:
`python -m pytest -m gpu tests/gpu/test_cuda_context.py`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHECK = """
import ctypes, sys
from layersplit.shards.cuda_context import context_ahead
thread = context_ahead("cuda:0")
assert thread is not None, "not started"
import torch
thread.join(timeout=60)
assert "torch" in sys.modules
x = torch.arange(6.0, device="cuda:0").reshape(2, 3)
assert (x @ x.T).sum().item() == 139.0
lib = ctypes.CDLL("libcuda.so.1")
current, primary, dev = ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int(0)
assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev) == 0
assert current.value and current.value == primary.value, (current.value, primary.value)
print("made ahead:", "cuda:0's context made ahead" in LOG.getvalue())
"""


def test_torch_takes_the_context_made_ahead():
    code = ("import io, logging; LOG = io.StringIO(); "
            "logging.basicConfig(stream=LOG, level=logging.DEBUG)\n" + CHECK)
    env = {**os.environ, "LAYERSPLIT_CUDA_CONTEXT_AHEAD": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=180, check=False, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "made ahead: True" in r.stdout, r.stdout
