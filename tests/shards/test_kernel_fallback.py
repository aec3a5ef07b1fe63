"""`shards.kernels.try_kernel`: a kernel that raises turns itself off for the process, once, with
a warning naming it, and its caller's torch path runs; the step's own errors propagate."""

from __future__ import annotations

import logging

import pytest
import torch
from layersplit.shards import kernels


def test_a_failing_kernel_is_off_from_then_on(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_FAILED", set())
    calls = []

    def broken(x):
        calls.append(x)
        raise RuntimeError("out of resource: shared memory\nmore detail")

    assert kernels.try_kernel("test kernel", lambda x: x + 1, 1) == 2
    assert not kernels.kernel_failed("test kernel")
    with caplog.at_level(logging.WARNING, logger="layersplit.shards.kernels"):
        assert kernels.try_kernel("test kernel", broken, 3) is None
    assert calls == [3] and kernels.kernel_failed("test kernel")
    assert not kernels.kernel_failed("another kernel")
    (record,) = caplog.records
    assert "test kernel" in record.message and "out of resource" in record.message
    assert "more detail" not in record.message  # (the first line only)


@pytest.mark.parametrize("err", [IndexError("KV cache holds 8 tokens"),
                                 torch.cuda.OutOfMemoryError("out of memory")])
def test_the_steps_own_errors_propagate(monkeypatch, err):
    monkeypatch.setattr(kernels, "_FAILED", set())

    def step(_):
        raise err

    with pytest.raises(type(err)):
        kernels.try_kernel("test kernel", step, 0)
    assert not kernels.kernel_failed("test kernel")
