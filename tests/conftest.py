"""Shared fixtures: tiny seeded checkpoints (no download) and the default model (fetched once)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

# Bytecode: README's test command installs without compiling (`pip --no-compile`, ~40 s less);
# a module is compiled when first imported and cached, in this process and its children (CLI
# runs, shard processes), even where the environment asks for no bytecode files: this suite
# starts hundreds of interpreters, each of which would otherwise compile every module again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from layersplit.shards.tiny import FAMILY_CONFIGS, write_tiny_checkpoint  # noqa: E402

torch.set_num_threads(1)  # shard processes run one thread each in tests: same arithmetic path


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_models(tiny_root) -> dict[str, Path]:
    """family -> HF folder, 6 layers each (splits into 1, 2, 3 shards)."""
    return {
        fam: write_tiny_checkpoint(tiny_root / fam, fam, files=2 if fam == "qwen2" else 1)
        for fam in FAMILY_CONFIGS
    }


@pytest.fixture(scope="session")
def hybrid_models(tiny_root) -> dict[str, Path]:
    """family -> a tiny Qwen3.5 (text) / Qwen3-Next folder written by transformers' own
    save_pretrained (6 layers, linear and full attention interleaved)."""
    from layersplit.shards.tiny import HYBRID_CONFIGS, write_tiny_hybrid

    return {fam: write_tiny_hybrid(tiny_root / f"hybrid-{fam}", fam) for fam in HYBRID_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def target(tmp_path_factory) -> Path:
    """The speculation and batching tests' target: a tiny Llama in a folder of its own, with
    `write_tiny_checkpoint`'s seeded weights at std 0.2 (the default now, so the same weights as
    `tiny_llama`'s): large enough that its greedy output varies and changes when any one
    layer's weights or KV rows are wrong."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama", std=0.2)


@pytest.fixture(scope="session")
def dflash(target, tmp_path_factory) -> Path:
    """A random DFlash draft for `target`, tapping a layer of each of 2 shards (0:3, 3:6)."""
    from layersplit.draft.dflash import write_random_dflash
    from layersplit.shards.model_config import read_hf_config

    return write_random_dflash(read_hf_config(target), tmp_path_factory.mktemp("dflash"),
                               layers=1, taps=[1, 4], block_size=4)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's GGUF, fetched once per machine into $LAYERSPLIT_HOME."""
    from layersplit.runtime.model_store import fetch_default_model

    return fetch_default_model()


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield


def pytest_sessionstart(session):
    """Start this process's zygote (`runtime.zygote`: CPU shard and draft processes fork from
    it) before collection: its imports (~2 s of a core) then overlap collection's on the other
    core instead of delaying the first test that starts a shard group."""
    if session.config.option.collectonly or (
            getattr(session.config.option, "numprocesses", None)
            and not hasattr(session.config, "workerinput")):  # (xdist's controller runs none)
        return
    from layersplit.runtime.zygote import ZygoteError, zygote

    try:
        zygote()
    except ZygoteError:  # (the first shard group starts it again, or says why it cannot)
        pass


# Started first on xdist's workers: the file whose time varies most from run to run (its Ray
# cluster and actors take 30-170 s of a worker on the 2-core VM, as the machine is loaded).
# xdist's loadfile hands out files by their number of tests, which put this one (6 tests)
# among the last: when it ran long, the other worker had nothing left to do.
FIRST_FILES = ("tests/runtime/test_ray_launcher.py",)


def pytest_configure(config):
    """xdist's controller hands out files in the workers' collection order (below)."""
    if hasattr(config.option, "loadscopereorder") and not hasattr(config, "workerinput"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: `FIRST_FILES`, then the files that start processes (those with a
    `slow` test), then the others, each group by its files' number of tests (the order xdist
    itself would give), each file's tests in their own order. The last files handed out are
    then unit tests of a second or less: a worker that finishes early finds work left while
    the other ends its last file (before, files of one multi-process test of 3-9 s each came
    last, and a worker could wait that long for the other). (Both workers sort alike: xdist
    checks that their collections are the same.)"""
    if not hasattr(config, "workerinput"):
        return
    count = Counter(item.nodeid.split("::")[0] for item in items)
    starts_processes = {item.nodeid.split("::")[0] for item in items
                        if item.get_closest_marker("slow") is not None}

    def rank(item):
        path = item.nodeid.split("::")[0]
        return (path not in FIRST_FILES, path not in starts_processes, -count[path])

    items.sort(key=rank)


def pytest_report_header(config):
    home = os.environ.get("LAYERSPLIT_HOME", "~/.cache/layersplit")
    return f"layersplit tests; LAYERSPLIT_HOME={home}"


def pytest_runtest_logreport(report):
    """Each failure's report appended, as it happens, to the file `LAYERSPLIT_TEST_FAILURES`
    names (device runs: a call cut at its deadline never prints pytest's summary)."""
    _write_failure(report, f"{getattr(report, 'when', '')}, {report.duration:.1f} s")


def pytest_collectreport(report):
    """... and each file that failed to collect (an import error: a wheel not carried)."""
    _write_failure(report, "collection")


def pytest_runtest_setup(item):
    """Where `LAYERSPLIT_TEST_FAILURES` is set: every thread's stack is appended to that file
    + `.stacks` if the test still runs 20 s before pytest-timeout's limit (faulthandler writes
    it from its own thread, so a test stuck in native code, which the timeout's signal or
    thread method may fail to report from an xdist worker, is still seen where it hangs)."""
    path = os.environ.get("LAYERSPLIT_TEST_FAILURES")
    marker = item.get_closest_marker("timeout")  # (`timeout(N)` or `timeout(timeout=N)`)
    mine = marker and (marker.args[0] if marker.args else marker.kwargs.get("timeout"))
    limit = None if not path else mine or (
        item.config.getoption("timeout", None) or item.config.getini("timeout"))
    if limit:
        import faulthandler

        global _stacks
        _stacks = _stacks or open(f"{path}.stacks", "a")  # noqa: SIM115 (open for the run)
        _stacks.write(f"=== {item.nodeid}: every thread's stack if it runs past "
                      f"{max(1.0, float(limit) - 20):.0f} s\n")
        _stacks.flush()
        faulthandler.dump_traceback_later(max(1.0, float(limit) - 20), file=_stacks)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """... cancelled once the test's teardown is over, fixtures' finalizers included (a hang
    there still dumps), and even where one of them raised (no dump left armed for the next
    test, which may never arm its own: a skip marker's test)."""
    yield
    if _stacks is not None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


_stacks = None  # the `.stacks` file, where a run writes stacks


def _write_failure(report, what: str) -> None:
    path = os.environ.get("LAYERSPLIT_TEST_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # (xdist's
        # controller writes its workers' reports, and theirs of a worker killed mid-test)
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({what})\n{report.longreprtext[-6000:]}\n")
