"""The environment a shard process starts with (`runtime.supervisor.shard_env`): its secret, and
on CUDA the root of the compile caches under the layersplit home (private; each process picks
its key's directory in it, `shards.compile_cache`), never over a user's own."""

from __future__ import annotations

import stat

from layersplit.ipc.auth import SECRET_ENV
from layersplit.runtime.supervisor import shard_env
from layersplit.shards.compile_cache import ROOT_ENV

KEYS = (ROOT_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")


def test_cuda_shards_compile_into_the_layersplit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "home"))
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    env = shard_env(b"\x01\x02", "cuda:0")
    root = tmp_path / "home" / "compile"
    assert env[ROOT_ENV] == str(root)
    assert "TRITON_CACHE_DIR" not in env  # (the process sets it: `compile_cache.use`)
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert env[SECRET_ENV] == "0102"


def test_a_users_own_cache_dirs_win_and_cpu_shards_get_none(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(ROOT_ENV, "/somewhere/else")
    env = shard_env(b"", "cuda:1")
    assert env[ROOT_ENV] == "/somewhere/else"
    monkeypatch.delenv(ROOT_ENV)
    assert ROOT_ENV not in shard_env(b"", "cpu")


def test_an_open_cache_dir_is_made_private_and_a_relative_home_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERSPLIT_HOME", "rel-home")
    monkeypatch.delenv(ROOT_ENV, raising=False)
    (tmp_path / "rel-home" / "compile").mkdir(parents=True, mode=0o755)
    (tmp_path / "rel-home" / "compile").chmod(0o755)
    env = shard_env(b"", "cuda:0")
    root = tmp_path / "rel-home" / "compile"
    assert env[ROOT_ENV] == str(root.resolve())
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_an_unwritable_home_keeps_torchs_defaults(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LAYERSPLIT_HOME", str(blocker))
    monkeypatch.delenv(ROOT_ENV, raising=False)
    env = shard_env(b"", "cuda:0")
    assert ROOT_ENV not in env


def test_a_ray_nodes_shard_gets_the_same_settings_under_that_nodes_home(tmp_path, monkeypatch):
    """(`ShardHost.start` runs on the shard's node: its layersplit home is that node's.)"""
    from layersplit.ipc.hosts import HOST_ID_ENV
    from layersplit.runtime.ray_launcher import process_env

    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "node-home"))
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    env = process_env(["--model", "m", "--device", "cuda:0", "--dtype", "auto"],
                      {SECRET_ENV: "0a"}, "node-7")
    assert env[SECRET_ENV] == "0a" and env[HOST_ID_ENV] == "node-7"
    assert env[ROOT_ENV] == str(tmp_path / "node-home" / "compile")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    cpu = process_env(["--device", "cpu"], {SECRET_ENV: "0a"}, "node-7")
    assert ROOT_ENV not in cpu and "PYTORCH_CUDA_ALLOC_CONF" not in cpu
