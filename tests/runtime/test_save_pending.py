"""CacheManager.pending: what an idle engine polls for while cache files are being written."""

from __future__ import annotations

import queue
import threading

from layersplit.runtime.cache_ops import CacheManager


def _bare() -> CacheManager:
    cache = CacheManager.__new__(CacheManager)  # (only the save bookkeeping is used)
    cache.jobs, cache._threads, cache.done = {}, [], queue.Queue()
    return cache


def test_a_written_save_is_pending_until_poll_done_applies_it():
    # the writer thread renamed the file and ended; the index learns of it in poll_done: an
    # idle server that stopped polling here would leave the entry unapplied (no path, still
    # "saving", the disk cap not enforced) until the next request
    cache = _bare()
    th = threading.Thread(target=lambda: cache.done.put("written"))
    th.start()
    th.join()
    cache._threads.append(th)
    assert cache.pending() == 1
    cache.done.get_nowait()  # (what poll_done does)
    assert cache.pending() == 0


def test_finished_writer_threads_are_let_go():
    # asked every engine step while idle: it must not cost the run's whole history of saves
    cache = _bare()
    for _ in range(50):
        th = threading.Thread(target=lambda: None)
        th.start()
        th.join()
        cache._threads.append(th)
    assert cache.pending() == 0
    assert cache._threads == []
