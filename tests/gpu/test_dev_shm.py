"""A GPU server leaves nothing in /dev/shm once its processes have exited: not our rings, and
not the `cuda.shm.*` files NVIDIA's driver makes for CUDA interprocess events (the cuda-ipc
edge's slot events, the token board's, the one torch makes for a shared ring buffer), which the
driver only removes in a teardown that our processes' `os._exit` skips (`ipc.shm`,
`release_cuda_event_files`). Two starts and stops of 2 GPU shards over cuda-ipc with a draft,
as `layersplit serve` runs them; before the fix each start left 5 files. Run on a CUDA machine:
`python -m pytest -m gpu tests/gpu/test_dev_shm.py`."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch
from layersplit.ipc.shm import _cuda_shm_pid
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

from tests.helpers import layersplit_shm, shard_children

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda_shm(every: bool = False) -> set[str]:
    """This user's `cuda.shm.*` files but those of live processes outside this test's tree
    (other test workers on the same GPU make their own while this test runs); `every`: all of
    this user's (the files before the runs: none of them can be theirs, and another worker's
    process that ends meanwhile must not make its file look new)."""
    mine = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    names = set()
    for p in Path("/dev/shm").glob("cuda.shm.*"):
        try:
            if p.stat().st_uid != os.getuid():
                continue
        except FileNotFoundError:  # (removed by its process meanwhile)
            continue
        pid = _cuda_shm_pid(p.name)
        if every or pid in mine or pid is None or not psutil.pid_exists(pid):
            names.add(p.name)
    return names


def test_starts_and_stops_leave_no_cuda_event_files(target, dflash):
    gpus = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")
    cfg = RuntimeConfig(model=str(target), devices=gpus, transport=("cuda-ipc",),
                        draft=str(dflash), max_context=256, prefill_chunk=16)
    before, ours = _cuda_shm(every=True), layersplit_shm()
    made: set[str] = set()
    ran: set[int] = set()  # the runs' processes
    for _ in range(2):
        with Coordinator(cfg) as c:
            assert c.shard_info()[0]["transport_out"] == "cuda-ipc"
            c.generate(list(range(3, 40)), SamplingParams(max_tokens=8, ignore_eos=True))
            pids = {p.pid for p in c.procs} | ({c._draft_proc.pid} if c._draft_proc else set())
            during = _cuda_shm() - before
            made |= during
            ran |= pids
            # (the files the run made are its processes': the driver names them by pid)
            assert {_cuda_shm_pid(n) for n in during} <= pids, (sorted(during), pids)
    left = {n for n in _cuda_shm() - before if _cuda_shm_pid(n) in ran}
    assert left == set(), f"left in /dev/shm: {sorted(left)} (made during the runs: {len(made)})"
    assert shard_children() == [] and layersplit_shm() - ours == set()
