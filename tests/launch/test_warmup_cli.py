"""`layersplit warmup` end to end on CPUs (a tiny model, 2 shards): it starts the run `serve`
would, runs every kind of step once (a restore from the disk cache among them) and exits; each
shard's compile-cache entry is written by the first warm-up, reused (not rewritten) by the next,
and a corrupt one is ignored with a warning naming it and written again."""

from __future__ import annotations

import json
import subprocess

import pytest
from layersplit.shards.compile_cache import ROOT_ENV

from tests.helpers import run_cli, shard_children


def _run(command: str, model, tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """The command run in this process (`run_cli`: its shards fork from this run's zygote, with
    the compile-cache root in their environment)."""
    return run_cli(command, *argv, "--model", str(model), "--devices", "cpu,cpu", "--threads",
                   "1", "--draft", "none", "--max-context", "384", "--prefill-chunk", "64",
                   "--kv-cache-dir", str(tmp_path / "kv"))


@pytest.mark.slow
def test_warmup_writes_reuses_and_rebuilds_its_cache_entries(tiny_llama, tmp_path,
                                                             monkeypatch, capfd):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "compile"))
    made = _run("generate", tiny_llama, tmp_path, "1 2 3 4 5 6 7 8 9 10 " * 8, "--token-ids",
                "--max-tokens", "2", "--json")
    assert made.returncode == 0, made.stderr[-3000:]
    prompt_tokens = json.loads(made.stdout)["prompt_tokens"]
    generates = set((tmp_path / "compile").glob("*/entries/*.json"))  # (its own: one slot)
    first = _run("warmup", tiny_llama, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "compile cache: written" in first.stderr
    assert "a prefill of 81 tokens and 8 greedy tokens" in first.stderr  # a chunk and a part
    assert "a sampled request" in first.stderr and "a batch of two" in first.stderr
    assert (f"a request for the {prompt_tokens} tokens of a disk-cache entry" in first.stderr
            and f"({prompt_tokens} tokens from the disk tier)" in first.stderr)
    entries = sorted(set((tmp_path / "compile").glob("*/entries/*.json")) - generates)
    assert [p.name.split("-")[1:3] for p in entries] == [["L0", "3"], ["L3", "6"]]
    assert all(json.loads(p.read_text())["what"]["layers"] in ([0, 3], [3, 6]) for p in entries)
    kept = entries[0].read_text()
    entries[1].write_text(entries[1].read_text()[:40])  # cut short
    capfd.readouterr()
    second = _run("warmup", tiny_llama, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    shards_said = capfd.readouterr().err  # (the shards' own stderr: they fork from the zygote)
    assert f"compile cache entry {entries[1]}: unreadable" in shards_said
    assert "warming up from the compile cache" in shards_said  # shard 0's entry
    assert "compile cache: reused, written" in second.stderr
    assert "compile cache entries: shard 0 reused, shard 1 written" in second.stderr
    assert entries[0].read_text() == kept  # reused, not rewritten
    assert json.loads(entries[1].read_text())["what"]["layers"] == [3, 6]  # rebuilt
    assert shard_children() == []
