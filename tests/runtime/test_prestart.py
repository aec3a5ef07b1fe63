"""Shard and draft processes started ahead (`runtime.supervisor.prestart_shards`,
`prestart_draft`): a run hands its local shards and its draft to them (the same processes serve,
with the same tokens as the reference); those it does not take are stopped; one given a bad
line on stdin refuses it by name, and one whose parent closes stdin without a word exits
quietly. `generate` sizes its run to its one request
(`Coordinator.fit_context`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import signal
import subprocess
import sys

import pytest
from layersplit.launch import processes
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.runtime.supervisor import (
    ARGV_ON_STDIN,
    drop_prestarted,
    prestart_draft,
    prestart_shards,
)
from layersplit.shards.sampling import SamplingParams

from tests.helpers import shard_children

P = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_a_run_takes_the_processes_started_ahead(target, dflash):
    prompt = list(range(5, 40))
    want = ReferenceEngine(target, prefill_chunk=16, max_context=256).generate(prompt, P)
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), max_context=256,
                        prefill_chunk=16, threads=1, draft=str(dflash))
    # (one shard more than the run needs; the draft after them, as `generate` starts it)
    ready = prestart_shards(["cpu", "cpu", "cpu"]) + prestart_draft("cpu")
    pids = [p.proc.pid for p in ready]
    try:
        with Coordinator(cfg, prestarted=ready) as coord:
            assert [p.pid for p in coord.procs] == pids[:2]
            assert coord.draft is not None and coord.draft.proc.pid == pids[3]
            assert ready == []  # (the third shard was stopped)
            out = coord.generate(prompt, P, use_cache=False)
            assert out.tokens == want.tokens and out.acceptance_length is not None
    finally:
        drop_prestarted(ready)
    assert shard_children() == []


@pytest.mark.slow
def test_unused_ones_are_stopped_and_a_bad_line_is_refused_by_name(monkeypatch):
    ready = prestart_shards(["cpu"])
    proc = ready[0].proc
    drop_prestarted(ready)
    assert ready == [] and proc.poll() is not None

    def run(role: str, line: bytes) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "layersplit.launch.cli", role, ARGV_ON_STDIN, "cpu"]
        return subprocess.run(cmd, input=line, capture_output=True, timeout=120, check=False)

    # processes of their own: one whose parent closes stdin without a word exits quietly, one
    # that reads a bad line exits 2 naming it (independent, each importing torch before it
    # reads its line: both at once)
    cases = [("shard", b"", 0, ""),
             ("shard", b"not json\n", 2, "a prestarted shard read a bad line on stdin")]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as ex:
        results = list(ex.map(run, [c[0] for c in cases], [c[1] for c in cases]))
    for (role, line, rc, said), r in zip(cases, results):
        assert r.returncode == rc and said.encode() in r.stderr, (role, line, r.stderr[-1000:])
    # what else a line can get wrong: the same command, run in this process (it returns
    # before it would serve)
    sigint = signal.getsignal(signal.SIGINT)  # (which it sets to ignored, as a shard does)
    for role, line, said in [
            ("shard", '{"argv": ["generate", "x"], "secret": "0102"}\n',
             "expected the shard command's arguments and a secret"),
            ("shard", '{"argv": ["shard"], "secret": "zz"}\n', "a bad line on stdin"),
            # a draft started ahead takes only the draft command's arguments
            ("draft", '{"argv": ["shard", "x"], "secret": "0102"}\n',
             "expected the draft command's arguments")]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(line))
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                rc = processes.main([role, ARGV_ON_STDIN, "cpu"])
        finally:
            signal.signal(signal.SIGINT, sigint)
        assert rc == 2 and said in err.getvalue(), (role, line, err.getvalue()[-1000:])


def test_fit_context_sizes_a_run_to_its_request(tiny_llama):
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu",), max_context=4096,
                        graph_bucket=256, threads=1)
    for prompt, max_tokens, want in [
            (5, 64, 256),  # rounded up to the graph bucket
            (300, 0, 512),  # (room for one token at least: 300 rows would refuse the prompt)
            (256, 0, 512),
            (3000, 2000, 4096),  # never more than it was
            (5000, 10, 4096)]:  # a prompt that does not fit: as before (refused by it)
        coord = Coordinator(cfg)
        coord.fit_context(prompt, max_tokens)
        assert coord.config.max_context == want, (prompt, max_tokens)
        coord.close()


def test_generate_runs_one_request_with_its_own_defaults():
    """`generate`: one KV slot and the draft's step uncompiled unless given (`draft_compile`:
    its compilation costs a one-request run more than it saves); the draft command is told."""
    from layersplit.launch.cli import build_parser, generate_config
    from layersplit.runtime.supervisor import draft_argv

    parser = build_parser()
    cfg = generate_config(parser.parse_args(["generate", "hi"]))
    assert (cfg.max_seqs, cfg.draft_compile) == (1, False)
    cfg = generate_config(parser.parse_args(["generate", "hi", "--draft-compile", "true",
                                             "--max-seqs", "3"]))
    assert (cfg.max_seqs, cfg.draft_compile) == (3, True)
    argv = draft_argv("d", "t", "cuda:0", "bfloat16", 256, None, compile=False)
    args = parser.parse_args(["draft", "--listen", "ipc:///x", *argv])
    assert args.no_compile and not parser.parse_args(
        ["draft", "--listen", "ipc:///x", *draft_argv("d", "t", "cpu", "float32", 256, 1)]
    ).no_compile
