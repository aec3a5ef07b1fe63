"""`shards.cuda_context` on a CUDA machine: switched on, the device's primary context is active
before torch is even imported (off: not), and it is the context torch's runtime then makes
current and computes on. Run on a CUDA machine:
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
if thread is not None:
    thread.join(timeout=60)
    assert not thread.is_alive(), "still making the context"
assert "torch" not in sys.modules
lib = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
print("active before torch:", active.value)
import torch
x = torch.arange(6.0, device="cuda:0").reshape(2, 3)
assert (x @ x.T).sum().item() == 83.0
current, primary = ctypes.c_void_p(0), ctypes.c_void_p(0)
assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev) == 0
assert current.value and current.value == primary.value, (current.value, primary.value)
"""


@pytest.mark.parametrize("on", [True, False])
def test_the_context_is_made_before_torch_and_torch_takes_it(on):
    env = {**os.environ, "LAYERSPLIT_CUDA_CONTEXT_AHEAD": "1" if on else "0"}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                       timeout=180, check=False, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"active before torch: {int(on)}" in r.stdout, r.stdout
