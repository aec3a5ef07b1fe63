"""A prestarted CUDA process's device context made beside its torch import
(`shards.cuda_context`): off unless switched on, only for CUDA devices, the driver's calls in
order with the device's ordinal, any failure (no libcuda here; a driver error) logged and
never raised, and a module that imports no torch (its thread must start before torch's import).
The context torch then takes is checked on a GPU (`tests/gpu/test_cuda_context.py`)."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

import pytest
from layersplit.runtime.supervisor import ARGV_ON_STDIN
from layersplit.shards import cuda_context
from layersplit.shards.cuda_context import SWITCH, context_ahead, cuda_ordinal, make_context


def test_cuda_ordinals():
    assert [cuda_ordinal(d) for d in ("cuda", "cuda:0", "cuda:3", "cpu", "cuda:x", "mps:0",
                                      "cuda:")] == [0, 0, 3, None, None, None, None]


def test_nothing_is_done_unless_switched_on_for_a_cuda_device(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert context_ahead("cuda:0") is None
    monkeypatch.setenv(SWITCH, "1")
    assert context_ahead("cpu") is None


class Driver:
    """libcuda's three calls as `make_context` makes them, each answering the CUresult given
    (0: success), recording what it was asked."""

    def __init__(self, **results: int) -> None:
        self.results, self.calls = results, []

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        self.calls.append(("cuInit", flags))
        return self.results.get("cuInit", 0)

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        self.calls.append(("cuDeviceGet", ordinal))
        ctypes.cast(dev, ctypes.POINTER(ctypes.c_int))[0] = 40 + ordinal
        return self.results.get("cuDeviceGet", 0)

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxRetain", dev.value))
        return self.results.get("cuDevicePrimaryCtxRetain", 0)


def test_the_driver_calls_in_order_and_a_failure_stops_them(caplog):
    lib = Driver()
    with caplog.at_level(logging.INFO, logger=cuda_context.__name__):
        assert make_context(2, lib)
        caplog.clear()
        cuda_context.report()  # (what was kept, logged once the process's logging is up)
        assert "cuda:2's context made ahead in" in caplog.text and not cuda_context.OUTCOME
    assert lib.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 42)]
    lib = Driver(cuDeviceGet=101)  # (CUDA_ERROR_INVALID_DEVICE)
    with caplog.at_level(logging.INFO, logger=cuda_context.__name__):
        assert not make_context(5, lib)
    assert lib.calls == [("cuInit", 0), ("cuDeviceGet", 5)]
    assert "cuDeviceGet returned CUresult 101" in caplog.text
    assert not make_context(0, object())  # (a library without the driver's functions)
    cuda_context.OUTCOME.clear()


def test_switched_on_without_a_driver_the_thread_logs_and_ends(monkeypatch, caplog):
    """On this machine (no libcuda, as CI's): started, logged, no error; CUDA_MODULE_LOADING
    set to LAZY where unset, as torch sets it before its own cuInit."""
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "x")  # (so that monkeypatch restores its absence)
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    monkeypatch.setattr(cuda_context, "LIBCUDA", "libcuda-not-here.so.1")
    with caplog.at_level(logging.INFO, logger=cuda_context.__name__):
        thread = context_ahead("cuda:1")
        assert thread is not None
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert "cuda:1's context not made ahead" in caplog.text
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    cuda_context.OUTCOME.clear()
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # (a user's own setting wins)
    context_ahead("cuda:0").join(timeout=30)
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    cuda_context.OUTCOME.clear()


def test_the_module_imports_no_torch():
    code = ("import sys; import layersplit.shards.cuda_context, layersplit.shards.switches; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_a_prestarted_cuda_shard_switched_on_without_a_driver_goes_on():
    """A shard started ahead for cuda:0 with the switch on, on a machine without the driver
    (no GPU here): the context is not made ahead, and the process reads its line as before
    (here none: it exits quietly)."""
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "shard", ARGV_ON_STDIN, "cuda:0"]
    env = {**os.environ, SWITCH: "1"}
    r = subprocess.run(cmd, input=b"", capture_output=True, timeout=120, check=False, env=env)
    assert r.returncode == 0 and b"Exception in thread" not in r.stderr, r.stderr[-2000:]
