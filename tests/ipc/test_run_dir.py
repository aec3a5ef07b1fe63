"""ipc.sockets.run_dir: the private folder of a process's ipc:// sockets, and the removal of
those whose process was killed before it could remove its own."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

from layersplit.ipc.sockets import run_dir


def test_run_dirs_of_gone_processes_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"layersplit-{int(gone.stdout)}-abc"  # (its process has exited)
    dead.mkdir()
    (dead / "shard0.sock").touch()
    dead_ray = tmp_path / f"layersplit-{int(gone.stdout)}-ray-abc"  # a Ray worker's error file
    dead_ray.mkdir()
    (dead_ray / "shard.error").touch()
    alive = tmp_path / f"layersplit-{os.getppid()}-def"  # a live process's: kept
    alive.mkdir()
    other = tmp_path / "layersplit-ray-xyz"  # not a pid: kept
    other.mkdir()
    mine = run_dir()
    assert not dead.exists() and not dead_ray.exists() and alive.exists() and other.exists()
    assert mine.parent == tmp_path and mine.name.startswith(f"layersplit-{os.getpid()}-")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert run_dir() != mine and mine.exists()  # (its own, alive: kept)
