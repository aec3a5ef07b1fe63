"""Shard processes started ahead (`runtime.supervisor.prestart_shards`): a run hands its local
shards to them (the same processes serve, with the same tokens as the reference); those it does
not take are stopped; one given a bad line on stdin refuses it by name, and one whose parent
closes stdin without a word exits quietly. `generate` sizes its run to its one request
(`Coordinator.fit_context`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.runtime.supervisor import ARGV_ON_STDIN, drop_prestarted, prestart_shards
from layersplit.shards.sampling import SamplingParams

from tests.helpers import shard_children

P = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_a_run_takes_the_processes_started_ahead(tiny_llama):
    prompt = list(range(5, 40))
    want = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256).generate(prompt, P)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), max_context=256,
                        prefill_chunk=16, threads=1)
    ready = prestart_shards(["cpu", "cpu", "cpu"])  # (one more than the run needs)
    pids = [p.proc.pid for p in ready]
    try:
        with Coordinator(cfg, prestarted=ready) as coord:
            assert [p.pid for p in coord.procs] == pids[:2]
            assert ready == []  # (the third was stopped)
            assert coord.generate(prompt, P, use_cache=False).tokens == want.tokens
    finally:
        drop_prestarted(ready)
    assert shard_children() == []


def test_unused_ones_are_stopped_and_a_bad_line_is_refused_by_name():
    ready = prestart_shards(["cpu"])
    proc = ready[0].proc
    drop_prestarted(ready)
    assert ready == [] and proc.poll() is not None
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "shard", ARGV_ON_STDIN, "cpu"]
    for line, rc, said in [
            (b"", 0, ""),  # (its parent closed stdin: not needed)
            (b"not json\n", 2, "a prestarted shard read a bad line on stdin"),
            (b'{"argv": ["generate", "x"], "secret": "0102"}\n', 2,
             "expected the shard command's arguments and a secret"),
            (b'{"argv": ["shard"], "secret": "zz"}\n', 2, "a bad line on stdin")]:
        r = subprocess.run(cmd, input=line, capture_output=True, timeout=120, check=False)
        assert r.returncode == rc and said.encode() in r.stderr, r.stderr[-1000:]


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
