"""The /dev/shm files of CUDA interprocess events (`ipc.shm.cuda_event_files`): a process
removes those it created at exit, the coordinator those of a dead child; files of other
processes are left alone. (The driver's own files are made on a GPU: tests/gpu/test_dev_shm.py.)"""

from __future__ import annotations

import os
import time

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
        assert sorted(cuda_event_files(me, 0.0)) == sorted(mine)
        # files older than the process (of another process that had its pid) are not its own
        assert cuda_event_files(me, time.time() + 60) == []
        assert sorted(release_cuda_event_files()) == sorted(p.name for p in mine)
        assert not any(p.exists() for p in mine) and theirs.exists() and odd.exists()
        assert sweep(other) == [theirs.name] and not theirs.exists()  # a dead child's
        assert release_cuda_event_files() == [] and odd.exists()
    finally:
        for p in (*mine, theirs, odd):
            p.unlink(missing_ok=True)


def test_a_file_gone_during_the_listing_loses_none_of_the_others():
    """A file that vanishes between the listing and its check (a process removing its own as
    it exits; here a link to nothing) costs only itself, not the whole sweep."""
    me = os.getpid() + 2_000_003
    mine = [_touch(f"cuda.shm.{os.getuid()}.{me:x}.{n}") for n in (1, 2)]
    gone = SHM_DIR / f"cuda.shm.{os.getuid()}.{me:x}.3"
    gone.symlink_to(SHM_DIR / f"layersplit-test-nothing-{me}")
    try:
        assert sorted(p.name for p in mine) == sorted(
            n for n in sweep(me) if n != gone.name)
        assert not any(p.exists() for p in mine)
    finally:
        for p in (*mine, gone):
            p.unlink(missing_ok=True)


def test_another_users_files_of_the_same_pid_are_left_alone():
    """A segment or event file of the dead child's pid that another user owns (a process of
    that pid in another pid namespace sharing /dev/shm) is neither removed nor an error."""
    pid = os.getpid() + 3_000_003
    seg = _touch(f"layersplit-{pid}-abcdef")
    ev = _touch(f"cuda.shm.{os.getuid()}.{pid:x}.1")
    other_uid = os.getuid() + 4242
    try:
        if os.getuid() == 0:  # (only root can give a file away)
            os.chown(seg, other_uid, -1)
            os.chown(ev, other_uid, -1)
            assert sweep(pid) == [] and seg.exists() and ev.exists()
        else:  # ours: removed
            assert sorted(sweep(pid)) == sorted([seg.name, ev.name])
    finally:
        seg.unlink(missing_ok=True)
        ev.unlink(missing_ok=True)
