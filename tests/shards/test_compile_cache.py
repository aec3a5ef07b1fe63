"""The compile cache's own files (`shards.compile_cache`): a key directory per versions and
device with its manifest, an entry per warm-up, written once and reused, and a corrupt or stale
one (ours, or a Triton autotuning result) removed with a warning naming it and rebuilt."""

from __future__ import annotations

import json
import logging
import os

from layersplit.shards import compile_cache
from layersplit.shards.compile_cache import CompileCache, key_name

V = {"torch": "2.13.0", "triton": "3.6.0", "cuda": "13.0", "device": "NVIDIA H200 sm90"}
WHAT = {"model": "/m/Qwen3-8B", "layers": [0, 18], "dtype": "bfloat16", "rows": [1, 32]}


def test_an_entry_is_written_once_then_reused(tmp_path):
    cache = CompileCache.open(tmp_path, V)
    assert cache.dir.name == key_name(V)
    assert cache.dir.name.startswith("NVIDIA_H200_sm90_torch2.13.0_triton3.6.0")
    assert cache.lookup(WHAT) is None
    path = cache.record(WHAT, 12.5, 40)
    again = CompileCache.open(tmp_path, V)  # (the next process on this machine)
    entry = again.lookup(WHAT)
    assert entry is not None and entry["seconds"] == 12.5 and entry["graphs"] == 40
    assert again.lookup({**WHAT, "rows": [1]}) is None  # other steps: another entry
    assert path.exists() and oct(cache.dir.stat().st_mode & 0o777) == "0o700"


def test_other_versions_or_devices_get_their_own_directory(tmp_path):
    a = CompileCache.open(tmp_path, V)
    others = [CompileCache.open(tmp_path, {**V, key: value}) for key, value in (
        ("torch", "2.12.1"), ("triton", "3.7.0"), ("cuda", "12.8"),
        ("device", "NVIDIA H100 sm90"), ("device", "NVIDIA H200 sm100"))]
    assert len({a.dir, *(o.dir for o in others)}) == 6
    assert a.env()["TRITON_CACHE_DIR"] == str(a.dir / "triton")


def test_a_corrupt_entry_is_ignored_with_a_warning_and_rebuilt(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, V)
    path = cache.record(WHAT, 3.0, 2)
    body = json.loads(path.read_text())
    body["seconds"] = 0.1  # edited: the checksum no longer holds
    path.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(WHAT) is None
    assert f"compile cache entry {path}: checksum mismatch" in caplog.text
    assert not path.exists()
    path.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(WHAT) is None
    assert "unreadable" in caplog.text and str(path) in caplog.text
    cache.record(WHAT, 3.0, 2)
    assert cache.lookup(WHAT)["seconds"] == 3.0


def test_a_stale_entry_is_ignored_with_a_warning_and_rebuilt(tmp_path, caplog):
    """An entry whose checksum holds but that names other versions (copied from another
    machine's directory) or other steps than its name says is not reused."""
    from layersplit.shards.compile_cache import _write_json

    cache = CompileCache.open(tmp_path, V)
    for stale in ({"versions": {**V, "triton": "3.5.0"}}, {"what": {**WHAT, "rows": [1]}}):
        path = cache.record(WHAT, 3.0, 2)
        body = json.loads(path.read_text())
        body.pop("sha256")
        _write_json(path, {**body, **stale})
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert cache.lookup(WHAT) is None
        assert f"compile cache entry {path}: stale" in caplog.text
        assert not path.exists()
    cache.record(WHAT, 4.0, 2)
    assert cache.lookup(WHAT)["seconds"] == 4.0


def test_a_corrupt_or_stale_manifest_empties_its_directory(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, V)
    cache.record(WHAT, 1.0, 1)
    (cache.dir / "triton").mkdir()
    (cache.dir / "triton" / "kernel.cubin").write_bytes(b"x")
    manifest = cache.dir / "manifest.json"
    body = json.loads(manifest.read_text())
    body.pop("sha256")
    body["versions"] = {**V, "torch": "2.12.0"}  # copied from a machine with another torch
    from layersplit.shards.compile_cache import _write_json

    _write_json(manifest, body)
    with caplog.at_level(logging.WARNING):
        again = CompileCache.open(tmp_path, V)
    assert f"compile cache {cache.dir}: manifest.json: stale" in caplog.text
    assert not (cache.dir / "triton").exists() and again.lookup(WHAT) is None
    assert json.loads(manifest.read_text())["versions"] == V
    manifest.write_text("garbage")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        CompileCache.open(tmp_path, V)
    assert "manifest.json: unreadable" in caplog.text


def test_an_unreadable_triton_autotuning_result_is_removed(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, V)
    good = cache.dir / "triton" / "ab12" / "chunk_fwd.autotune.json"
    bad = cache.dir / "triton" / "cd34" / "gemv.autotune.json"
    for p in (good, bad):
        p.parent.mkdir(parents=True)
    good.write_text(json.dumps({"key": [1], "configs_timings": []}))
    bad.write_text('{"key": [1], "configs_tim')  # cut short
    with caplog.at_level(logging.WARNING):
        CompileCache.open(tmp_path, V)
    assert good.exists() and not bad.exists()
    assert f"Triton autotuning result {bad} is unreadable" in caplog.text


def test_use_points_the_compilers_at_the_key_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ROOT_ENV, str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own")  # a user's own wins
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache = compile_cache.use("cpu")
    assert cache is not None and compile_cache.current() is cache
    assert cache.dir.parent == tmp_path and (cache.dir / "manifest.json").exists()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.dir / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own"
    monkeypatch.delenv(compile_cache.ROOT_ENV)
    monkeypatch.setattr(compile_cache, "_current", None)
    assert compile_cache.use("cpu") is None


def test_a_process_keys_its_cache_by_its_versions_and_gpu_model(monkeypatch):
    """`versions`: torch's, Triton's and CUDA's versions, and the GPU's name and compute
    capability, of the device the process computes on (torch.cuda's answers stand in for a
    GPU's here)."""
    import platform
    from importlib import metadata

    import torch

    cpu = compile_cache.versions("cpu")
    assert cpu["torch"] == torch.__version__ and cpu["cuda"] == (torch.version.cuda or "none")
    try:
        assert cpu["triton"] == metadata.version("triton")
    except metadata.PackageNotFoundError:
        assert cpu["triton"] == "none"
    assert cpu["device"] == f"cpu {platform.machine()}"
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: asked.append(i) or
                        ("NVIDIA H200" if i == 1 else "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    gpu = compile_cache.versions("cuda:1")
    assert gpu == {**cpu, "device": "NVIDIA H200 sm90"} and asked == [1]
    assert key_name(gpu) != key_name(compile_cache.versions("cuda:0")) != key_name(cpu)
