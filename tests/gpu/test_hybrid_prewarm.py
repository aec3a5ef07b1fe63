"""The process a hybrid shard starts on a machine's first start (`shards.hybrid_prewarm`)
compiles, into the compile cache the shard's process uses, every kernel the shard's own prefill
then needs: a second process running the same forward there compiles nothing new. And once it
ran, the next start spawns none. (Only where fla-core's configs are shipped for the GPU and
the shape: else none is spawned.)

On a CUDA device with fla-core installed (`python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from layersplit.shards import compile_cache, hybrid_prewarm
from layersplit.shards.checkpoint import open_checkpoint
from layersplit.shards.kernels.fla_loading import configs_in_force

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _compiled(cache: compile_cache.CompileCache) -> set[str]:
    return {p.name for p in (cache.dir / "triton").rglob("*.cubin")}


def test_the_process_compiles_what_the_shards_prefill_loads(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ROOT_ENV, str(tmp_path))
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(compile_cache, "_current", None)
    cache = compile_cache.use("cuda:0")
    for key in cache.env():  # (`use` set them in this process: undone after the test)
        monkeypatch.setenv(key, os.environ[key])
    cfg = open_checkpoint("random:qwen3.5-27b").config
    proc = hybrid_prewarm.spawn(cfg, 0, 8, torch.device("cuda:0"), "bfloat16")
    shape = hybrid_prewarm.shape_of(cfg, 0, 8, "bfloat16")
    if not hybrid_prewarm.configs_cover(configs_in_force(torch.cuda.get_device_name(0)), shape):
        assert proc is None  # (no configs shipped for this GPU and shape: the first prefill
        return  # autotunes alone, as before)
    assert proc is not None
    hybrid_prewarm.finish(proc)
    assert proc.returncode == 0
    assert hybrid_prewarm._done(shape)
    compiled = _compiled(cache)
    assert len(compiled) >= 5  # fla-core's conv and chunked delta rule's kernels at least
    # a shard's process: the same forward, on the same cache, compiles nothing more
    args = {"device": "cuda:0", "parent_pid": os.getpid(), "shape": shape}
    again = subprocess.run([sys.executable, "-m", "layersplit.shards.hybrid_prewarm",
                            json.dumps(args)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _compiled(cache) == compiled
    # and the next start spawns none
    assert hybrid_prewarm.spawn(cfg, 0, 8, torch.device("cuda:0"), "bfloat16") is None
