"""The environment a shard process starts with (`runtime.supervisor.shard_env`): its secret, and
on CUDA the compile caches under the layersplit home (private), never over a user's own."""

from __future__ import annotations

import stat

from layersplit.ipc.auth import SECRET_ENV
from layersplit.runtime.supervisor import shard_env


def test_cuda_shards_compile_into_the_layersplit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "home"))
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(key, raising=False)
    env = shard_env(b"\x01\x02", "cuda:0")
    root = tmp_path / "home" / "compile"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(root / "triton")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert env[SECRET_ENV] == "0102"


def test_a_users_own_cache_dirs_win_and_cpu_shards_get_none(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = shard_env(b"", "cuda:1")
    assert env["TRITON_CACHE_DIR"] == "/somewhere/else"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "home"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in shard_env(b"", "cpu")


def test_an_open_cache_dir_is_made_private_and_a_relative_home_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERSPLIT_HOME", "rel-home")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "rel-home" / "compile").mkdir(parents=True, mode=0o755)
    (tmp_path / "rel-home" / "compile").chmod(0o755)
    env = shard_env(b"", "cuda:0")
    root = tmp_path / "rel-home" / "compile"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root.resolve() / "inductor")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_an_unwritable_home_keeps_torchs_defaults(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LAYERSPLIT_HOME", str(blocker))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = shard_env(b"", "cuda:0")
    assert "TORCHINDUCTOR_CACHE_DIR" not in env


def test_a_ray_nodes_shard_gets_the_same_settings_under_that_nodes_home(tmp_path, monkeypatch):
    """(`ShardHost.start` runs on the shard's node: its layersplit home is that node's.)"""
    from layersplit.ipc.hosts import HOST_ID_ENV
    from layersplit.runtime.ray_launcher import process_env

    monkeypatch.setenv("LAYERSPLIT_HOME", str(tmp_path / "node-home"))
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(key, raising=False)
    env = process_env(["--model", "m", "--device", "cuda:0", "--dtype", "auto"],
                      {SECRET_ENV: "0a"}, "node-7")
    assert env[SECRET_ENV] == "0a" and env[HOST_ID_ENV] == "node-7"
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "node-home" / "compile" / "triton")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    cpu = process_env(["--device", "cpu"], {SECRET_ENV: "0a"}, "node-7")
    assert "TRITON_CACHE_DIR" not in cpu and "PYTORCH_CUDA_ALLOC_CONF" not in cpu
