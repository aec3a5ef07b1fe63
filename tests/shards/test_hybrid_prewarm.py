"""Compiling a hybrid model's prefill kernels ahead (`shards.hybrid_prewarm`): which ranges ask
for it, the process itself (run for real, on the CPU: its forward is the torch path there) and
its compile cache entry."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from layersplit.shards import compile_cache, fused_hybrid, hybrid_prewarm
from layersplit.shards.checkpoint import open_checkpoint
from layersplit.shards.model_config import read_hf_config as load_config


@pytest.fixture()
def qwen3_5(hybrid_models):
    return hybrid_models["qwen3_5"]


def test_only_ranges_with_linear_attention_layers_are_warmed(qwen3_5, tiny_llama):
    cfg = load_config(qwen3_5)
    linear = [i for i in range(cfg.num_layers) if cfg.hybrid.is_linear(i)]
    full = [i for i in range(cfg.num_layers) if not cfg.hybrid.is_linear(i)]
    shape = hybrid_prewarm.shape_of(cfg, 0, cfg.num_layers, "bfloat16")
    assert shape["num_v_heads"] == cfg.hybrid.num_value_heads and shape["dtype"] == "bfloat16"
    assert shape["fuse"] is True
    assert hybrid_prewarm.shape_of(cfg, full[0], full[0] + 1, "bfloat16") is None
    assert hybrid_prewarm.shape_of(cfg, linear[0], linear[0] + 1, "float32") is not None
    assert hybrid_prewarm.shape_of(load_config(tiny_llama), 0, 1, "bfloat16") is None


def test_the_shape_says_whether_the_shard_fuses(qwen3_5, monkeypatch):
    monkeypatch.setenv(fused_hybrid.ENV_SWITCH, "0")
    cfg = load_config(qwen3_5)
    assert hybrid_prewarm.shape_of(cfg, 0, cfg.num_layers, "float32")["fuse"] is False


def test_no_process_on_a_cpu(qwen3_5):
    cfg = load_config(qwen3_5)
    assert hybrid_prewarm.spawn(cfg, 0, cfg.num_layers, torch.device("cpu"), "float32") is None


@pytest.mark.parametrize("fuse", [True, False])
def test_the_forward_leaves_the_layer_as_it_was(qwen3_5, fuse):
    cfg = load_config(qwen3_5)
    shape = {**hybrid_prewarm.shape_of(cfg, 0, cfg.num_layers, "float32"), "fuse": fuse}
    layer = hybrid_prewarm.build_layer(shape, torch.device("cpu"))
    assert (layer.in_proj is not None) == fuse
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    hybrid_prewarm.prewarm_layer(layer, lengths=(5, 16))
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_the_process_runs_and_writes_its_entry(qwen3_5, tmp_path, monkeypatch):
    """The very process `spawn` starts (here on the CPU, which `spawn` itself never asks for):
    it builds the layer, runs its forward and writes the compile cache entry that later starts
    read (`_done`), then exits 0."""
    cfg = load_config(qwen3_5)
    shape = hybrid_prewarm.shape_of(cfg, 0, cfg.num_layers, "float32")
    env = {**os.environ, compile_cache.ROOT_ENV: str(tmp_path)}
    args = {"device": "cpu", "parent_pid": os.getpid(), "shape": shape}
    done = subprocess.run([sys.executable, "-m", "layersplit.shards.hybrid_prewarm",
                           json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "prefill kernels compiled ahead in" in done.stderr
    monkeypatch.setenv(compile_cache.ROOT_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "_current", None)
    for key in compile_cache.CompileCache.env(compile_cache.use("cpu")):
        monkeypatch.delenv(key, raising=False)  # (`use` set them here)
    assert hybrid_prewarm._done(shape)
    assert not hybrid_prewarm._done({**shape, "dtype": "bfloat16"})


def test_a_failed_or_slow_process_is_said_and_ended(caplog):
    caplog.set_level(logging.WARNING)
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    hybrid_prewarm.finish(failed)
    assert "exited with 4" in caplog.text
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hybrid_prewarm.finish(slow, timeout=0.2)
    assert slow.returncode is not None and "took more than" in caplog.text
    hybrid_prewarm.finish(None)
    hybrid_prewarm.stop(None)


def test_switched_off_nothing_is_warmed(qwen3_5, monkeypatch):
    monkeypatch.setenv(hybrid_prewarm.SWITCH, "0")
    cfg = load_config(qwen3_5)
    assert hybrid_prewarm.shape_of(cfg, 0, cfg.num_layers, "bfloat16") is None


def test_configs_cover_only_the_shipped_heads_and_dtype(tmp_path):
    """(the H200's shipped configs: Qwen3.5's 16 x 48 and 16 x 32 heads, bfloat16)"""
    from layersplit.shards.kernels.fla_loading import shipped_configs

    cfg = open_checkpoint("random:qwen3.5-27b").config
    shape = hybrid_prewarm.shape_of(cfg, 0, 4, "bfloat16")
    h200 = shipped_configs("NVIDIA H200")
    assert hybrid_prewarm.configs_cover(h200, shape)
    assert not hybrid_prewarm.configs_cover(h200, {**shape, "dtype": "float32"})
    assert not hybrid_prewarm.configs_cover(h200, {**shape, "num_v_heads": 24})
    assert not hybrid_prewarm.configs_cover(None, shape)
    (tmp_path / "chunk_fwd_kernel_o.json").write_text("{not json")
    assert not hybrid_prewarm.configs_cover(tmp_path, shape)
