"""A prestarted CUDA shard's (or draft's) device context, made beside its torch import.

A process started ahead for a CUDA device (`runtime.handover`) imports torch first (1.6-5 s of
CPU on an H200's host) and only then makes the device's context (`torch.zeros(1, device=...)`):
the driver's `cuInit` and the device's primary context, the driver's own work, which holds no
Python lock. Made first, in a thread of its own through the driver API (libcuda, by ctypes,
which lets go of the GIL for the call), the context is ready when torch asks for it: torch's
CUDA runtime takes the device's primary context, the one retained here. This module imports
no torch, so that the thread starts before torch's import does.

Off (`LAYERSPLIT_CUDA_CONTEXT_AHEAD=1` turns it on): on an H200 the Qwen3.5-27B shape's start
gained nothing with it (docs/configuration.md, warm-up and the compile cache;
`STARTUP=hybrid_ab`). Any failure
(no libcuda: a CPU machine or ROCm; a driver error) is logged and leaves the context to torch,
which reports its own errors as before. The process's logging is set up only once its
arguments come, after this: what happened is kept (`OUTCOME`) and logged then (`report`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SWITCH = "LAYERSPLIT_CUDA_CONTEXT_AHEAD"
LIBCUDA = "libcuda.so.1"
OUTCOME: list[str] = []  # (what `make_context` did, for `report` once logging is set up)


def cuda_ordinal(device: str) -> int | None:
    """The device ordinal of a `cuda` or `cuda:N` device string, None for any other."""
    if device == "cuda":
        return 0
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def context_ahead(device: str) -> threading.Thread | None:
    """Start making `device`'s context in a thread (the module's doc), where switched on and
    `device` is a CUDA one: the thread, already started; None where nothing is done.
    `CUDA_MODULE_LOADING` is set to LAZY first where unset, as torch sets it before its own
    `cuInit` (the driver reads it there)."""
    from layersplit.shards.switches import switched_on

    ordinal = cuda_ordinal(device)
    if ordinal is None or not switched_on(SWITCH):
        return None
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    thread = threading.Thread(target=make_context, args=(ordinal,), name="cuda-context",
                              daemon=True)
    thread.start()
    return thread


def make_context(ordinal: int, lib: Any = None) -> bool:
    """`cuInit`, then the primary context of device `ordinal` retained (kept for the process's
    life: torch's runtime retains it too), through `lib` (libcuda's functions; None: loaded
    here). Whether the context was made; what happened is logged (a failure never raised) and
    kept for `report`."""
    t0 = time.perf_counter()
    try:
        if lib is None:
            lib = ctypes.CDLL(LIBCUDA)
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        for name, call in (("cuInit", lambda: lib.cuInit(0)),
                           ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), ordinal)),
                           ("cuDevicePrimaryCtxRetain",
                            lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
            rc = call()
            if rc != 0:
                return _kept(f"cuda:{ordinal}'s context not made ahead: {name} returned "
                             f"CUresult {rc}; torch makes it", False)
    except (OSError, AttributeError) as e:  # (no libcuda here, or not the driver's)
        return _kept(f"cuda:{ordinal}'s context not made ahead ({e}); torch makes it", False)
    return _kept(f"cuda:{ordinal}'s context made ahead in {time.perf_counter() - t0:.3f} s",
                 True)


def _kept(message: str, made: bool) -> bool:
    log.info("%s", message)
    OUTCOME.append(message)
    return made


def report() -> None:
    """Log what `make_context` did (once the process's logging is set up), if it ran."""
    while OUTCOME:
        log.info("%s", OUTCOME.pop(0))
