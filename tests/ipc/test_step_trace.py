"""Per-step traces (`LAYERSPLIT_STEP_TRACE`, `ipc/step_trace.py`): a real 2-shard run writes one
private file per process, and `bench/step_timeline.py` lines their events up by step; unset,
nothing is written."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
from layersplit.ipc.step_trace import ENV, step_trace
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    """The benchmark script `bench/NAME.py` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timeline():
    return _bench("step_timeline")


def test_unset_means_no_trace_and_a_folder_that_cannot_be_used_is_left_alone(monkeypatch,
                                                                                 tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert step_trace("coordinator") is None
    monkeypatch.setenv(ENV, "")
    assert step_trace("coordinator") is None
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    monkeypatch.setenv(ENV, str(shared))
    assert step_trace("coordinator") is None  # (not private: not used, not changed)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755 and not list(shared.iterdir())
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(ENV, str(tmp_path / "file" / "sub"))
    assert step_trace("coordinator") is None  # (an OSError: logged, no trace)
    monkeypatch.setenv(ENV, str(tmp_path / "new"))
    a, b = step_trace("coordinator"), step_trace("coordinator")  # two files of one process
    a("send", 1)
    a.close()
    a("send", 2)  # (after close: nothing)
    b.close()
    files = sorted((tmp_path / "new").iterdir())
    assert len(files) == 2 and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    assert sum(len(f.read_text().splitlines()) for f in files) == 1


@pytest.mark.slow
def test_a_split_run_traces_every_step_on_every_process(target, tmp_path, monkeypatch):
    folder = tmp_path / "trace"
    monkeypatch.setenv(ENV, str(folder))
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=128, threads=1, draft="none", prefix_cache=False)
    for tokens in (6, 4):  # two runs in one folder: their sids are told apart
        with Coordinator(cfg) as c:
            out = c.generate(list(range(3, 40)),
                             SamplingParams(max_tokens=tokens, ignore_eos=True))
        assert len(out.tokens) == tokens
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    names = sorted(p.name.rsplit("-", 2)[0] for p in folder.iterdir())
    assert names == ["coordinator"] * 2 + ["shard-0-3"] * 2 + ["shard-3-6"] * 2
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in folder.iterdir())
    tl = _timeline()
    runs = tl.load(folder)
    assert len(runs) == 2
    assert [sum(k == "decode" for k in run[1].values()) for run in runs] == [5, 3]
    events, kinds, shards, sent = runs[0]
    assert all(sent[sid]["seqs"] == 1 for sid in kinds)
    assert shards == ["shard-0-3", "shard-3-6"]
    # prefill chunks, then decode steps (the first token comes with the last chunk)
    assert sorted(set(kinds.values())) == ["decode", "prefill"]
    for sid in kinds:  # every step went through both shards and came back
        assert {"recv", "run", "queued", "sent"} <= set(events["shard-0-3"][sid])
        assert {"recv", "run", "queued", "sent"} <= set(events["shard-3-6"][sid])
        assert events["coordinator"][sid]["send"] <= events["shard-0-3"][sid]["recv"] <= \
            events["shard-3-6"][sid]["recv"] <= events["coordinator"][sid]["result"]
    got = tl.summary(folder)
    decode = got["decode"]
    for stage in ("to shard 0", "shard 0 queues its kernels", "hop to shard 1",
                  "shard 1 samples", "result to the coordinator", "total"):
        assert decode[stage]["steps"] == 5 + 3
        assert 0 <= decode[stage]["median_ms"] <= decode[stage]["p90_ms"]
    assert decode["total"]["median_ms"] >= decode["hop to shard 1"]["median_ms"]
    full = tl.flow(folder)
    assert full["decode"]["steps"] == 8 and full["decode"]["mean seqs"] == 1
    assert full["prefill"]["mean rows"] > 1
    shares = [v for k, v in full["chain"].items() if k.startswith("in flight")]
    assert abs(sum(shares) - 1) < 1e-6 and full["chain"]["in flight 0"] < 1


@pytest.mark.slow
def test_speculating_steps_trace_the_drafts_verdicts_and_proposals(target, dflash, tmp_path,
                                                                    monkeypatch):
    folder = tmp_path / "trace"
    monkeypatch.setenv(ENV, str(folder))
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=128, threads=1, draft=str(dflash), draft_device="cpu",
                        prefix_cache=False)
    with Coordinator(cfg) as c:
        out = c.generate(list(range(3, 40)), SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.acceptance_length is not None
    assert any(p.name.startswith("draft-") for p in folder.iterdir())
    got = _timeline().summary(folder)["verify"]
    for stage in ("shard 0 held", "verdict reaches the draft", "draft prepares the proposal",
                  "the proposal reaches the first shard", "total"):  # (handed over: spec_push)
        assert got[stage]["steps"] >= 1, stage
        assert got[stage]["median_ms"] >= 0, stage
    # one sequence's rounds along their critical path: every stage of every round found
    path = _timeline().rounds(folder)
    n = path["round"]["steps"]
    assert n >= 1 and path["coordinator late"]["of"] == n and path["round"]["median_ms"] > 0
    assert all(path[label]["steps"] == n for label, _, _ in _timeline().ROUND_STAGES)


def test_a_kernel_profile_setting_that_cannot_be_used_is_named_and_ignored(monkeypatch,
                                                                              tmp_path, caplog):
    from layersplit.shards.kernel_profile import ENV as KENV
    from layersplit.shards.kernel_profile import kernel_profile

    monkeypatch.delenv(KENV, raising=False)
    assert kernel_profile("shard-0-3") is None
    for bad in (f"{tmp_path}/k:0:5", f"{tmp_path}/k:2:many"):
        monkeypatch.setenv(KENV, bad)
        assert kernel_profile("shard-0-3") is None
        assert KENV in caplog.text and "DIR:SKIP:STEPS" in caplog.text
    monkeypatch.setenv(KENV, f"{tmp_path}/k:2:3")
    prof = kernel_profile("shard-0-3")
    assert prof is not None and (prof.skip, prof.steps) == (2, 3)
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o700


@pytest.mark.slow
def test_a_kernel_profile_records_the_steps_it_names_on_every_process(target, dflash, tmp_path,
                                                                       monkeypatch):
    from layersplit.shards.kernel_profile import ENV as KENV

    folder = tmp_path / "kprof"
    monkeypatch.setenv(KENV, f"{folder}:2:3")
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=128, threads=1, draft=str(dflash), draft_device="cpu",
                        prefix_cache=False)
    with Coordinator(cfg) as c:
        c.generate(list(range(3, 40)), SamplingParams(max_tokens=16, ignore_eos=True))
    names = sorted(p.name.rsplit("-", 2)[0] for p in folder.iterdir())
    assert names == ["draft", "shard-0-3", "shard-3-6"]
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in folder.iterdir())
    ks = _bench("kernel_summary")
    for trace in folder.iterdir():
        got = ks.summarize(trace)
        assert got["kind"] == "cpu_op" and got["ops"] > 0 and got["span_us"] > 0
        assert 0 < got["busy_us"] <= got["summed_us"] and got["top"]


def test_kernel_summary_per_step_divides_a_trace_by_its_steps(tmp_path):
    """`kernel_summary.per_step`: a trace of 2 steps, 4 kernels (two overlapping) within a
    100 µs span: per step 2 kernels, 12.5 µs busy (the union; 15 summed), 50 µs span, 37.5 µs
    gap."""
    ks = _bench("kernel_summary")
    events = [{"ph": "X", "cat": "cpu_op", "name": "step", "ts": 0, "dur": 100}]
    for ts, dur, name in ((0, 10, "gemv"), (5, 10, "gemv"), (40, 5, "attn"), (60, 5, "gemv")):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur})
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = ks.per_step(ks.summarize(trace), 2)
    assert (got["kernels"], got["busy_us"], got["summed_us"]) == (2, 12.5, 15)
    assert (got["span_us"], got["gap_us"]) == (50, 37.5)
    assert got["top"][0] == {"name": "gemv", "per_step": 1.5, "us_per_step": 12.5}


def test_kernel_summary_by_grid_keeps_a_kernels_widths_apart(tmp_path):
    """`summarize(..., by_grid=True)`: one kernel's launches at two grids are two rows, each
    with its own count and time; without it, one row."""
    ks = _bench("kernel_summary")
    events = [{"ph": "X", "cat": "kernel", "name": "_gemv", "ts": ts, "dur": dur,
               "args": {"grid": grid, "block": [128, 1, 1]}}
              for ts, dur, grid in ((0, 40, [8240, 1, 1]), (50, 80, [17408, 1, 1]),
                                    (140, 42, [8240, 1, 1]))]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = {t["name"]: (t["count"], t["total_us"])
            for t in ks.summarize(trace, by_grid=True)["top"]}
    assert rows == {"_gemv grid [8240, 1, 1] block [128, 1, 1]": (2, 82),
                    "_gemv grid [17408, 1, 1] block [128, 1, 1]": (1, 80)}
    assert [(t["name"], t["count"]) for t in ks.summarize(trace)["top"]] == [("_gemv", 3)]
