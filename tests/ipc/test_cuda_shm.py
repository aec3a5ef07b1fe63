"""The /dev/shm files of CUDA interprocess events (`ipc.shm.cuda_event_files`): a process
removes those it created at exit, the coordinator those of a dead child; files of other
processes are left alone. (The driver's own files are made on a GPU: tests/gpu/test_dev_shm.py.)"""

from __future__ import annotations

import os

from layersplit.ipc.shm import SHM_DIR, cuda_event_files, release_cuda_event_files, sweep


def _touch(name: str):
    p = SHM_DIR / name
    p.write_bytes(b"\0" * 16)
    return p


def test_a_processs_own_event_files_go_and_no_others():
    me, other = os.getpid(), os.getpid() + 1_000_003
    mine = [_touch(f"cuda.shm.{os.getuid()}.{me:x}.{n}") for n in (1, 2)]
    theirs = _touch(f"cuda.shm.{os.getuid()}.{other:x}.1")
    odd = _touch(f"cuda.shm.{me:x}")  # (not the driver's layout: never touched)
    try:
        assert sorted(cuda_event_files(me)) == sorted(mine)
        assert sorted(release_cuda_event_files()) == sorted(p.name for p in mine)
        assert not any(p.exists() for p in mine) and theirs.exists() and odd.exists()
        assert sweep(other) == [theirs.name] and not theirs.exists()  # a dead child's
        assert release_cuda_event_files() == [] and odd.exists()
    finally:
        for p in (*mine, theirs, odd):
            p.unlink(missing_ok=True)
