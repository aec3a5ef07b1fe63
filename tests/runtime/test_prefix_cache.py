"""Invariant 3: output after a RAM or disk restore equals the cold output; invariant 4 for
cache files: nothing half-written is ever visible, nothing bad is ever read back."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from layersplit.runtime.cache_admin import verify
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.prefix_cache import BusySpans
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams
from safetensors import safe_open

from tests.helpers import (
    assert_same_logits,
    assert_same_run,
    layersplit_shm,
    run_cli,
    run_logged,
    shard_children,
    wait_gone,
)

CHUNK = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
# Restored runs are compared to cold ones by their tokens and by the logits at every generated
# position, bit for bit (`tests.helpers.assert_same_run`).


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=512)


@pytest.fixture(scope="module")
def prompts(ref):
    base = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
    return base, base + ref.tokenizer.encode(" and then it ran far away into the woods")


@pytest.fixture(scope="module")
def short_entries(tiny_llama, prompts, tmp_path_factory) -> Path:
    """The cache directory a two-shard chain leaves after a greedy run of the short prompt:
    its two entries (the last chunk boundary and the whole prompt, a delta child), written
    once for the tests that start from them (`with_short_entries` copies them, modes and
    all, into a test's own directory)."""
    d = tmp_path_factory.mktemp("short-entries")
    with Coordinator(cfg(tiny_llama, 2, d)) as c:
        c.generate(prompts[0], GREEDY)
    assert len(entries(d)) == 2
    return d


def with_short_entries(short_entries: Path, d: Path) -> None:
    """`d` as a two-shard chain leaves it after a greedy run of the short prompt (what
    `with Coordinator(cfg(tiny_llama, 2, d)) as c: c.generate(short, GREEDY)` writes)."""
    shutil.copytree(short_entries, d, dirs_exist_ok=True)


def cfg(model, n=2, cache_dir=None, **kw):
    kw = {"max_context": 512, **kw}
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         threads=1, kv_cache_dir=str(cache_dir) if cache_dir else None, **kw)


def entries(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3])
def test_ram_and_disk_hits_equal_cold(tiny_llama, ref, prompts, tmp_path, n):
    short, longer = prompts
    want = {(id(p), i): run_logged(ref, p, params) for p in prompts
            for i, params in enumerate((GREEDY, SAMPLED))}
    with Coordinator(cfg(tiny_llama, n, tmp_path)) as c:
        got = run_logged(c, short, GREEDY)
        assert (got[0].cache_tier, got[0].cached_tokens) == ("none", 0)
        assert_same_run(got, want[id(short), 0], "cold")
        for params, i in ((GREEDY, 0), (SAMPLED, 1)):  # exact hit: no forward pass at all
            got = run_logged(c, short, params)
            assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", len(short))
            assert_same_run(got, want[id(short), i], "exact RAM hit")
        got = run_logged(c, longer, SAMPLED)  # partial hit at the last chunk boundary
        assert got[0].cache_tier == "ram"
        assert got[0].cached_tokens == len(short) // CHUNK * CHUNK
        assert_same_run(got, want[id(longer), 1], "partial RAM hit")
    with Coordinator(cfg(tiny_llama, n, tmp_path)) as c:  # a restart: the disk tier
        for p in (short, longer):
            got = run_logged(c, p, GREEDY)
            assert got[0].cache_tier == "disk" and got[0].cached_tokens == len(p)
            assert_same_run(got, want[id(p), 0], "disk hit")
        assert c.cache.stats.hits_disk == 2
        got = run_logged(c, longer, SAMPLED)  # now from the RAM copy the disk restore left
        assert got[0].cache_tier == "ram"
        assert_same_run(got, want[id(longer), 1], "RAM hit after a disk restore")
    assert shard_children() == []


@pytest.mark.slow
def test_snapshots_wait_for_the_first_token(tiny_llama, ref, prompts, tmp_path):
    """A prompt's snapshots are taken once its first token is out (the next step's output
    is back), not on its way; one that stops at its first token is snapshotted as it ends; the
    entries restore into the cold run's output."""
    from layersplit.runtime.generate import Progress

    short, longer = prompts
    with Coordinator(cfg(tiny_llama, 2, tmp_path)) as c:
        stream = c.stream(short, GREEDY, Progress())
        next(stream)  # the first token is out ...
        assert c.cache.cached_rows(short) == 0 and not c.cache.index.entries
        next(stream)  # ... then the snapshots: the last chunk boundary and the whole prompt
        assert c.cache.cached_rows(short) == len(short)
        stream.close()
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        c.generate(longer, one)  # (it ends at its first token: snapshotted as it ends)
        assert c.cache.cached_rows(longer) == len(longer)
        for p in prompts:
            got = run_logged(c, p, GREEDY)
            assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", len(p))
            assert_same_run(got, run_logged(ref, p, GREEDY), "restored")
    assert shard_children() == []


@pytest.mark.slow
def test_cross_split_restore(tiny_llama, ref, prompts, short_entries, tmp_path):
    short, longer = prompts
    want = run_logged(ref, longer, GREEDY)
    with_short_entries(short_entries, tmp_path)  # a 2-shard chain's entries
    # 1 shard reads the 2-shard files (and writes the longer prompt's entries), then an uneven
    # 3-shard split reads the 1-shard file: an exact hit, no forward pass
    for n, split, cached in ((1, None, len(short) // CHUNK * CHUNK), (3, (1, 3, 2), len(longer))):
        with Coordinator(cfg(tiny_llama, n, tmp_path, split=split)) as c:
            got = run_logged(c, longer, GREEDY)
            assert got[0].cache_tier == "disk" and got[0].cached_tokens == cached
            assert_same_run(got, want, f"{n} shards restoring another split's entries")


@pytest.mark.slow
def test_file_layout_is_plain_safetensors(tiny_llama, prompts, tmp_path):
    short, _ = prompts
    tmp_path = tmp_path / "new" / "kv"  # created by the cache: private (0700)
    with Coordinator(cfg(tiny_llama, 2, tmp_path)) as c:
        c.generate(short, GREEDY)
        kv_heads, head_dim = c.model_config.num_kv_heads, c.model_config.head_dim
        vocab = c.model_config.vocab_size
    assert (tmp_path.stat().st_mode & 0o777) == 0o700
    files = entries(tmp_path)
    assert len(files) == 2  # the last chunk boundary, and the whole prompt (a delta child)
    for f in files:
        assert verify(f) is None
        assert (f.stat().st_mode & 0o777) == 0o600
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            start, length = int(meta["start"]), int(meta["length"])
            names = set(st.keys())
            assert names == {f"ls{s}.L{layer}.{k}"
                             for s, layers in ((0, range(3)), (1, range(3, 6)))
                             for layer in layers for k in "kv"} | {"tokens", "prefill_logits"}
            assert st.get_tensor("ls1.L4.v").shape == (length - start, kv_heads, head_dim)
            assert st.get_tensor("tokens").tolist() == short[:length]
            assert st.get_tensor("prefill_logits").shape == (vocab,)
            assert json.loads(meta["split"]) == [[0, 3], [3, 6]]
            assert set(json.loads(meta["checksums"])) == names
            for key in ("fingerprint", "key", "parent", "kv_layout", "created", "version"):
                assert key in meta
    child = [f for f in files if safe_open(str(f), "pt").metadata()["parent"]]
    assert len(child) == 1


@pytest.mark.slow
def test_ten_turn_chat_writes_only_new_rows(tiny_llama, tmp_path):
    # the replies are random bytes, some of them 3 tokens each once they are text again
    ref = ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=1024)
    tok = ref.tokenizer
    msgs = [{"role": "system", "content": "You answer briefly."}]
    turns = []
    with Coordinator(cfg(tiny_llama, 2, tmp_path, max_context=1024)) as c:
        row_bytes = c.cache.row_bytes
        for i in range(10):
            msgs.append({"role": "user", "content": f"question number {i} about foxes"})
            prompt = tok.encode_chat(msgs)
            before = c.cache.stats.bytes_written
            got = run_logged(c, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
            c._finish_saves(30)
            written = c.cache.stats.bytes_written - before
            turns.append((prompt, got, written))
            msgs.append({"role": "assistant", "content": got[0].text})
        st = c.cache.stats
        assert 0 < st.save_wall_s <= st.save_s  # (saves overlap: wall time, not their sum)
        assert 0 <= st.save_copy_wait_s <= st.save_s  # (the waits are part of the saves)
    for i, (prompt, got, written) in enumerate(turns):
        assert_same_run(got, run_logged(ref, prompt, SamplingParams(max_tokens=6,
                                                                    ignore_eos=True)),
                        f"turn {i}")
        r = got[0]
        if i:
            assert r.cache_tier == "ram" and r.cached_tokens > 0
            new_rows = len(prompt) - r.cached_tokens
            # only rows after the restored prefix are written (plus tokens, logits, headers)
            assert written < (new_rows + 4) * row_bytes + 2 * (len(prompt) * 4 + 1400 + 4096)
            assert written < len(prompt) * row_bytes  # never the whole prefix again
    last_prompt = turns[-1][0]
    want = run_logged(ref, last_prompt, GREEDY)
    # restart: through the chain
    with Coordinator(cfg(tiny_llama, 2, tmp_path, max_context=1024)) as c:
        got = run_logged(c, last_prompt, GREEDY)
        assert got[0].cache_tier == "disk" and got[0].cached_tokens == len(last_prompt)
        assert_same_run(got, want, "the whole chat restored from disk")
        chain = c.cache.index.chain(c.cache.index.entries[
            c.cache.keys(last_prompt, [len(last_prompt)])[len(last_prompt)]])
        assert len(chain) >= 8
        middle = chain[len(chain) // 2]
    middle.path.unlink()  # a missing middle link: restore stops at the last good one
    with Coordinator(cfg(tiny_llama, 2, tmp_path, max_context=1024)) as c:
        got = run_logged(c, last_prompt, GREEDY)
        assert got[0].cache_tier == "disk" and got[0].cached_tokens == middle.start
        assert_same_run(got, want, "the chat restored up to a missing link")


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "flip":
        data[8 + n + 10] ^= 0xFF  # inside the first KV tensor
        path.write_bytes(bytes(data))
    elif how == "header":
        data[8:8 + n] = bytes(data[8:8 + n]).replace(b'"version":"1"', b'"version":"9"')
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif how == "checksums":  # well-formed JSON, nonsense metadata: same length, same offsets
        head = bytes(data[8:8 + n])
        i = head.index(b'"checksums":"') + len(b'"checksums":"')
        j = head.index(b'"', head.index(b"}", i))
        bad = b'5' + b" " * (j - i - 1)
        data[8 + i:8 + j] = bad
        path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "flip", "header", "garbage", "checksums"])
def test_corrupt_files_are_misses(tiny_llama, ref, prompts, short_entries, tmp_path, how,
                                  caplog):
    _, longer = prompts
    with_short_entries(short_entries, tmp_path)
    root = [f for f in entries(tmp_path) if not safe_open(str(f), "pt").metadata()["parent"]][0]
    _corrupt(root, how)
    caplog.set_level(logging.WARNING)
    with Coordinator(cfg(tiny_llama, 2, tmp_path)) as c:
        got = run_logged(c, longer, GREEDY)
        assert_same_run(got, run_logged(ref, longer, GREEDY), f"after a {how} file")
        assert got[0].cache_tier == "none" and got[0].cached_tokens == 0
        assert c.cache.stats.bad_files >= 1
    assert any("unusable" in m or "mismatch" in m for m in caplog.messages)
    assert not root.exists() and root.with_name(root.name + ".bad").exists()


@pytest.mark.slow
def test_entries_of_another_model_are_ignored(tiny_models, ref, prompts, tmp_path):
    short, _ = prompts
    with Coordinator(cfg(tiny_models["llama-linear-rope"], 2, tmp_path)) as c:
        c.generate(short[:40], GREEDY)
    other = entries(tmp_path)
    with Coordinator(cfg(tiny_models["llama"], 2, tmp_path)) as c:
        got = run_logged(c, short[:40], GREEDY)
        assert got[0].cache_tier == "none"
        assert_same_run(got, run_logged(ref, short[:40], GREEDY), "beside another model's")
    assert all(p.exists() for p in other)  # another model's files are left alone


def _generate(model, prompt, cache_dir, *extra) -> list[str]:
    """`layersplit generate`'s arguments on 2 CPU shards with the disk cache in `cache_dir`."""
    return ["generate", prompt, "--model", str(model), "--devices", "cpu,cpu", "--threads", "1",
            "--prefill-chunk", str(CHUNK), "--kv-cache-dir", str(cache_dir), "--json", *extra]


def _cli(model, prompt, cache_dir, *extra):
    return [sys.executable, "-m", "layersplit.launch.cli",
            *_generate(model, prompt, cache_dir, *extra)]


@pytest.mark.slow
def test_restart_persistence_via_cli(tiny_llama, ref, tmp_path):
    text = "the quick brown fox jumps over the lazy dog " * 4
    longer = text + "and then it ran far away"
    # a server-like run stopped with SIGTERM while it decodes: saves still complete
    p = subprocess.Popen(_cli(tiny_llama, text, tmp_path, "--max-tokens", "100000",
                              "--ignore-eos"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(entries(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    assert len(entries(tmp_path)) == 2 and all(verify(f) is None for f in entries(tmp_path))
    # two restarts, each restoring from the entries the first run left (the longer prompt
    # first: what the other writes, it does not need; it restores the short one's chunks), as
    # commands run in this process (`run_cli`: the same command, in a coordinator that never
    # saw these prompts)
    dumps = [tmp_path.parent / f"{tmp_path.name}-logits{i}.npy"  # (outside the cache dir)
             for i in range(2)]
    runs = {prompt: run_cli(*_generate(tiny_llama, prompt, tmp_path, "--max-tokens", "8",
                                       "--ignore-eos", "--dump-logits", str(dump)))
            for prompt, dump in ((longer, dumps[1]), (text, dumps[0]))}
    outs = [runs[text], runs[longer]]
    for i, (prompt, dump, out) in enumerate(zip((text, longer), dumps, outs)):
        res = json.loads(out.stdout)
        ids = ref.tokenizer.encode(prompt)
        assert res["cache_tier"] == "disk"
        assert res["cached_tokens"] == (len(ids) if prompt == text else
                                        len(ref.tokenizer.encode(text)) // CHUNK * CHUNK)
        want, want_logits = run_logged(ref, ids, SamplingParams(max_tokens=8, ignore_eos=True))
        assert res["tokens"] == want.tokens
        assert_same_logits(np.load(dump), want_logits, f"CLI restart, prompt {i}")


@pytest.mark.slow
def test_kill9_mid_save_leaves_no_partial_entry(tiny_llama, ref, tmp_path):
    text = "a rather long prompt about foxes and dogs and cats " * 30
    before = layersplit_shm()
    for _ in range(3):
        p = subprocess.Popen(_cli(tiny_llama, text, tmp_path, "--max-tokens", "100000",
                                  "--ignore-eos", "--max-context", "4096"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.tmp")) and not entries(tmp_path) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
        kids = [k.pid for k in shard_children(p.pid)]
        p.kill()
        p.wait(10)
        assert wait_gone(kids, 10) == []  # the orphaned shards notice and exit
        for f in entries(tmp_path):  # whatever is visible is complete and correct
            assert verify(f) is None, f
    with Coordinator(cfg(tiny_llama, 2, tmp_path, max_context=4096)) as c:
        assert not list(tmp_path.glob("*.tmp"))  # dead writers' partial files are removed
        ids = ref.tokenizer.encode(text)
        big_ref = ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=4096)
        assert_same_run(run_logged(c, ids, GREEDY), run_logged(big_ref, ids, GREEDY),
                        "after coordinators killed mid-save")
    assert shard_children() == [] and layersplit_shm() - before == set()


@pytest.mark.slow
def test_two_servers_share_a_directory(tiny_llama, ref, prompts, tmp_path):
    short, longer = prompts
    with Coordinator(cfg(tiny_llama, 1, tmp_path)) as a, \
            Coordinator(cfg(tiny_llama, 2, tmp_path)) as b:
        ra = a.generate(short, GREEDY)
        rb = b.generate(short, GREEDY)  # same keys, written twice: atomic renames, same bytes
        a._finish_saves(30)
        b._finish_saves(30)
        assert ra.tokens == rb.tokens
        assert all(verify(f) is None for f in entries(tmp_path))
        # a fresh server on the same directory does not delete the others' files
        with Coordinator(cfg(tiny_llama, 1, tmp_path)) as c:
            assert c.generate(longer, GREEDY).cache_tier == "disk"
        assert len(entries(tmp_path)) >= 2


@pytest.mark.slow
def test_size_caps_evict_leaves_first(tiny_llama, ref, tmp_path):
    tok = ref.tokenizer
    with Coordinator(cfg(tiny_llama, 2, tmp_path, kv_cache_max_gb=60e3 / 2**30,
                         cache_ram_gb=40e3 / 2**30)) as c:
        for i in range(6):
            c.generate(tok.encode(f"prompt {i} " * 20), GREEDY)
            c._finish_saves(30)
            idx = c.cache.index
            assert idx.disk_bytes() <= 60e3 and idx.ram_bytes() <= 40e3, [
                (e.key[:6], e.start, e.length, e.in_ram, e.path is not None, e.saving, e.pins,
                 e.parent and e.parent[:6]) for e in idx.entries.values()]
            for e in idx.entries.values():  # no child without its parent
                assert e.parent is None or e.parent in idx.entries
        assert c.cache.stats.evicted_disk > 0 and c.cache.stats.evicted_ram > 0


@pytest.mark.slow
def test_cache_cli(short_entries, tmp_path):
    with_short_entries(short_entries, tmp_path)
    run = lambda *a: run_cli("cache", *a)  # noqa: E731
    out = run("ls", str(tmp_path))
    assert out.returncode == 0 and "2 entries" in out.stdout
    assert run("verify", str(tmp_path)).returncode == 0
    _corrupt(entries(tmp_path)[0], "flip")
    bad = run("verify", str(tmp_path))
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout
    out = run("prune", str(tmp_path), "--max-gb", "0")
    assert out.returncode == 0 and entries(tmp_path) == []


@pytest.mark.slow
def test_slow_disk_is_not_read(tiny_llama, ref, prompts, short_entries, tmp_path):
    """When the measured disk rate makes a restore slower than the measured prefill, the
    runtime prefills instead (and the output is the same)."""
    short, longer = prompts
    with_short_entries(short_entries, tmp_path)
    with Coordinator(cfg(tiny_llama, 2, tmp_path)) as c:
        assert c.cache.choose(len(short), len(short), 10**6) == "restore"  # rates unknown
        c.cache.note_prefill(len(short), len(short), 0.01)  # a fast prefill
        c.cache.disk_rate = 1e3  # and a very slow disk
        assert c.cache.choose(len(short), len(short), 10**6) == "prefill"
        got = run_logged(c, longer, GREEDY)
        assert got[0].cache_tier == "none" and c.cache.stats.skipped_slow_restore == 1
        assert_same_run(got, run_logged(ref, longer, GREEDY), "prefilled instead")
        c.cache.disk_rate = 1e12  # a fast disk: restore again
        assert c.generate(longer, GREEDY).cache_tier in ("disk", "ram")


@pytest.mark.slow
def test_disk_hit_with_one_token_then_other_prompt(tiny_llama, ref, prompts, short_entries,
                                                   tmp_path):
    """A disk restore whose request ends at its first token must not leave a pending RAM copy
    that would later snapshot another prompt's rows under the old key."""
    short, longer = prompts
    with_short_entries(short_entries, tmp_path)
    other = ref.tokenizer.encode("a completely different prompt about cats and mice " * 3)
    with Coordinator(cfg(tiny_llama, 2, tmp_path)) as c:
        r = c.generate(short, SamplingParams(max_tokens=1, ignore_eos=True))
        assert r.cache_tier == "disk"
        assert_same_run(run_logged(c, other, GREEDY), run_logged(ref, other, GREEDY), "other")
        again = run_logged(c, short, GREEDY)
        assert again[0].cached_tokens == len(short)
        assert_same_run(again, run_logged(ref, short, GREEDY), "the first prompt again")
        assert_same_run(run_logged(c, longer, GREEDY), run_logged(ref, longer, GREEDY),
                        "a longer prompt")


def test_save_wall_time_is_the_union_of_saves_ending_in_any_order():
    spans = BusySpans()
    # a later, smaller save ends first; then one inside both; then one after an idle gap
    added = [spans.add(5.0, 10.0), spans.add(0.0, 11.0), spans.add(2.0, 3.0),
             spans.add(20.0, 21.0), spans.add(10.5, 12.0), spans.add(4.0, 4.0)]
    assert added == [5.0, 6.0, 0.0, 1.0, 1.0, 0.0]
    assert spans.spans == [(0.0, 12.0), (20.0, 21.0)]
    assert spans.add(11.0, 22.0) == 9.0 and spans.spans == [(0.0, 22.0)]
