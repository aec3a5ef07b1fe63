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


def _entry(key: str):
    from layersplit.runtime.prefix_cache import Entry

    e = Entry.__new__(Entry)  # (the fields poll_done reads and writes)
    e.key, e.saving, e.path = key, True, None
    return e


def test_poll_done_applies_a_finished_save_then_the_caps_once(tmp_path):
    applied: list = []
    saves = _saves(tmp_path, applied)
    e = _entry("kept")
    saves.index.entries[e.key] = e
    final = tmp_path / "kept.safetensors"
    final.write_bytes(b"x" * 10)
    saves.done.put((e, final, 10, None, (1.0, 3.0, 0.5)))
    saves.poll_done()
    assert e.path == final and not e.saving and applied == [1]
    st = saves.stats
    assert (st.saves, st.bytes_written, st.save_s, st.save_copy_wait_s) == (1, 10, 2.0, 0.5)
    saves.poll_done()  # (nothing new: the caps do not run again)
    assert applied == [1] and saves.pending() == 0


def test_a_save_that_never_starts_fails_its_key_and_is_not_held(tmp_path):
    """A save cancelled at its start (or abandoned with its shards): its partial file goes,
    its key counts as failed (a delta entry after it is not put in place without it), and
    nothing keeps it."""
    import os

    from layersplit.runtime.prefix_cache import SaveJob

    saves = _saves(tmp_path)
    jobs = []
    for key in ("a", "b"):
        e = _entry(key)
        e.ram_id = len(jobs)
        tmp = tmp_path / f"{key}.tmp"
        tmp.write_bytes(b"")
        jobs.append(SaveJob(e, None, tmp, os.open(tmp, os.O_RDONLY), {0}, {}))
        saves.add(jobs[-1])
    saves.cancel(jobs[0])
    saves.abandon()
    assert saves.failed == {"a", "b"} and saves.by_key == {} and saves.jobs == {}
    assert not any(j.tmp.exists() or j.entry.saving for j in jobs)
    assert all(j.renamed.is_set() and not j.ok for j in jobs)
    again = SaveJob(jobs[0].entry, None, jobs[0].tmp, -1, {0}, {})
    saves.add(again)  # (saved again: the later deltas wait for this save, not its failure)
    assert saves.failed == {"b"} and saves.by_key == {"a": again}


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
    applied: list = []
    saves = _saves(tmp_path, applied)
    final = tmp_path / "gone.safetensors"
    final.write_bytes(b"x")
    e = _entry("gone")
    saves.done.put((e, final, 1, None, (0.0, 1.0, 0.0)))
    saves.poll_done()
    assert not final.exists() and not e.saving and applied == []
    assert saves.stats.saves == 0
