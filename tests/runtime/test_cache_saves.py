"""runtime/cache_saves.py: `DiskSaves.pending`, what an idle engine polls for while cache files
are being written, and `poll_done`, which applies finished saves to the index."""

from __future__ import annotations

import threading

from layersplit.runtime.cache_saves import DiskSaves
from layersplit.runtime.prefix_cache import PrefixIndex


def _saves(tmp_path, applied: list | None = None) -> DiskSaves:
    index = PrefixIndex("fp", 1 << 30, tmp_path, 1 << 30)
    return DiskSaves(index, lambda rows: rows, lambda: applied.append(1) if applied is not None
                     else None)


def test_a_written_save_is_pending_until_poll_done_applies_it(tmp_path):
    # the writer thread renamed the file and ended; the index learns of it in poll_done: an
    # idle server that stopped polling here would leave the entry unapplied (no path, still
    # "saving", the disk cap not enforced) until the next request
    saves = _saves(tmp_path)
    th = threading.Thread(target=lambda: saves.done.put("written"))
    th.start()
    th.join()
    saves._threads.append(th)
    assert saves.pending() == 1
    saves.done.get_nowait()  # (what poll_done does)
    assert saves.pending() == 0


def test_finished_writer_threads_are_let_go(tmp_path):
    # asked every engine step while idle: it must not cost the run's whole history of saves
    saves = _saves(tmp_path)
    for _ in range(50):
        th = threading.Thread(target=lambda: None)
        th.start()
        th.join()
        saves._threads.append(th)
    assert saves.pending() == 0
    assert saves._threads == []


def test_a_save_of_an_entry_dropped_meanwhile_removes_its_file_and_changes_nothing(tmp_path):
    """A finished save whose entry left the index while it was written: its file is removed
    (no entry reaches it) and the caller's caps are not run for it."""
    from layersplit.runtime.prefix_cache import Entry

    applied: list = []
    saves = _saves(tmp_path, applied)
    final = tmp_path / "gone.safetensors"
    final.write_bytes(b"x")
    e = Entry.__new__(Entry)
    e.key, e.saving = "gone", True
    saves.done.put((e, final, 1, None, (0.0, 1.0, 0.0)))
    saves.poll_done()
    assert not final.exists() and not e.saving and applied == []
    assert saves.stats.saves == 0
