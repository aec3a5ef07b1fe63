"""GPU path tests (run on a CUDA machine: `python -m pytest -m gpu`).

The CUDA-graph decode step against the eager step and the CPU, and the split runtime over
cuda-ipc against one GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections
from layersplit.shards.sampling import SamplingParams

from tests.gpu import near
from tests.helpers import layersplit_shm, shard_children, trace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gpus() -> list[str]:
    n = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if n >= 2 else ["cuda:0", "cuda:0"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4_moe", "gpt_oss"])
def test_graph_decode_matches_eager_and_cpu(tiny_models, family):
    """(GLM-4.5 and gpt-oss run unfused, gpt-oss's sinks in the graphs' grouped attention.)"""
    ckpt = open_checkpoint(tiny_models[family])
    cpu = RangeExecutor(load_layer_range(ckpt, 0, 6), 256, device="cpu")
    eager = RangeExecutor(load_layer_range(ckpt, 0, 6, torch.float32, "cuda:0"), 256,
                          device="cuda:0", static_decode=False)
    graph = RangeExecutor(load_layer_range(ckpt, 0, 6, torch.float32, "cuda:0"), 256,
                          device="cuda:0", static_decode=True, graph_bucket=32)
    fused_model = load_layer_range(ckpt, 0, 6, torch.float32, "cuda:0")
    fuse_projections(fused_model, compile=True)
    fused = RangeExecutor(fused_model, 256, device="cuda:0", static_decode=True, graph_bucket=32)
    assert graph.static is not None and graph.static.capture
    runs = (cpu, eager, graph, fused)
    ids = torch.arange(3, 43)
    for ex in runs:
        ex.run(ids, 0)
    t = [int(ids[-1])] * len(runs)
    for pos in range(40, 120):
        outs = [ex.run(torch.tensor([tok]), pos).float().cpu() for ex, tok in zip(runs, t)]
        assert near(outs[1], outs[2], 1e-4)
        assert near(outs[0], outs[2], 1e-3)
        assert near(outs[0], outs[3], 1e-3)
        t = [int(o.argmax()) for o in outs]
        assert len(set(t)) == 1
    assert len(graph.static.graphs) >= 3  # buckets 64, 96, 128 were captured
    if family in ("llama", "qwen3"):
        fast = fused_model.layers[0].fast  # the kernels ran (a dense layer compiles nothing)
        assert fast.kernels and fast.compiled


def test_bf16_graph_decode_tracks_eager(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    eager = RangeExecutor(load_layer_range(ckpt, 0, 6, torch.bfloat16, "cuda:0"), 256,
                          device="cuda:0", static_decode=False)
    graph = RangeExecutor(load_layer_range(ckpt, 0, 6, torch.bfloat16, "cuda:0"), 256,
                          device="cuda:0", static_decode=True)
    ids = torch.arange(3, 30)
    a, b = eager.run(ids, 0), graph.run(ids, 0)
    for pos in range(27, 40):
        a = eager.run(torch.tensor([5]), pos)
        b = graph.run(torch.tensor([5]), pos)
        assert near(a, b, 0.1)


@pytest.mark.parametrize("fused", [False, True])
def test_graph_batched_decode_matches_single_steps(tiny_models, fused):
    """Captured batched steps (windows of 2, 4 and all 6 slots, KV buckets 32 and 64) give each
    sequence's own CUDA-graph decode step: logits and KV rows."""
    torch._dynamo.reset()  # (8 compiled shapes per function and process: earlier tests' go)
    ckpt = open_checkpoint(tiny_models["qwen3"])

    def executor() -> RangeExecutor:
        model = load_layer_range(ckpt, 0, 6, torch.float32, "cuda:0")
        if fused:
            fuse_projections(model, compile=True)
        return RangeExecutor(model, 256, 6, device="cuda:0", static_decode=True, graph_bucket=32)

    single, batched = executor(), executor()
    pos = [5, 30, 12, 40, 21, 8]
    for slot, n in enumerate(pos):
        for ex in (single, batched):
            ex.run(torch.arange(3, 3 + n), 0, slot)
    tok = [7] * len(pos)
    for slots in ([0, 2, 3], [3, 1], [0, 5], [5, 0, 1, 2, 3, 4], [4]) * 8:
        ids = [tok[s] for s in slots]
        out = batched.static.run_batch(torch.tensor(ids), slots, [pos[s] for s in slots])
        # (a graph's output is a static buffer the next replay may reuse: copy at once)
        want = torch.cat([single.run(torch.tensor([t]), pos[s], s).clone()
                          for s, t in zip(slots, ids)])
        assert near(out.cpu(), want.float().cpu(), 1e-3)
        for s, row in zip(slots, want):
            tok[s], pos[s] = int(row.argmax()), pos[s] + 1
    assert batched.static.capture and len(batched.static.batch_graphs) >= 6
    assert near(single.kv.k, batched.kv.k, 1e-3)
    assert near(single.kv.v, batched.kv.v, 1e-3)
    if fused:  # (no fallback: the kernels and, where they are off, the compiled stages)
        fast = batched.model.layers[0].fast
        assert fast.batched.compiled and fast.kernels


@pytest.mark.parametrize("transport", ["cuda-ipc", "shm", "zmq"])
def test_two_gpu_split_equals_one_gpu(tiny_llama, transport):
    before = layersplit_shm()
    base = {"model": str(tiny_llama), "prefill_chunk": 16, "max_context": 256,
            "dtype": "float32"}
    one = RuntimeConfig(devices=("cuda:0",), **base)
    two = RuntimeConfig(devices=tuple(_gpus()), transport=(transport,), **base)
    prompt = list(range(3, 60))
    with Coordinator(one) as c:
        ref_tokens, ref_logits = trace(c, prompt, 24, 16)
    with Coordinator(two) as c:
        assert c.shard_info()[0]["transport_out"] == transport
        tokens, logits = trace(c, prompt, 24, 16)
        p = SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True)
        sampled = c.generate(prompt, p).tokens
    assert tokens == ref_tokens
    assert abs(logits - ref_logits).max() < 1e-4
    with Coordinator(one) as c:
        assert c.generate(prompt, p).tokens == sampled
    assert shard_children() == [] and layersplit_shm() - before == set()


def test_device_check_counts_as_torch_does_without_importing_it():
    """The coordinator's device check counts without torch: the quick count (no driver call)
    and the driver's equal torch's, `CUDA_VISIBLE_DEVICES` applied, and a check that passes
    imports no torch."""
    code = ("import sys; from layersplit.runtime.placement import ShardPlan, Placement, "
            "check_local_devices, cuda_device_count, visible_cuda_devices; "
            "n = cuda_device_count(); "
            "n and check_local_devices(Placement((ShardPlan(0, 0, 1, f'cuda:{n - 1}', None),), "
            "())); print(visible_cuda_devices(), n, 'torch' in sys.modules); "
            "import torch; print(torch.cuda.device_count())")
    for visible in (None, "0", ""):
        env = dict(os.environ)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        quick, driver, imported, want = out
        assert (quick, driver, imported) == (want, want, "False"), (visible, out)


def test_auto_picks_cuda_ipc_between_gpus(tiny_llama):
    cfg = RuntimeConfig(model=str(tiny_llama), devices=tuple(_gpus()), max_context=128)
    with Coordinator(cfg) as c:
        assert c.shard_info()[0]["transport_out"] == "cuda-ipc"
        assert len(c.generate(list(range(3, 20)),
                              SamplingParams(max_tokens=5, ignore_eos=True)).tokens) == 5


def test_prefix_cache_on_gpus(tiny_llama, tmp_path):
    """RAM and disk restores on GPUs (pinned snapshots, side-stream copies, pipelined verified
    reads) continue exactly like the cold run."""
    base = {"model": str(tiny_llama), "prefill_chunk": 16, "max_context": 256,
            "dtype": "float32", "kv_cache_dir": str(tmp_path)}
    cfg = RuntimeConfig(devices=tuple(_gpus()), **base)
    prompt = list(range(3, 90))
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    with Coordinator(cfg) as c:
        cold = c.generate(prompt, p)
        warm = c.generate(prompt + [5, 6, 7], p)
        assert warm.cache_tier == "ram" and warm.cached_tokens == 80
        again = c.generate(prompt, p)
        assert again.cache_tier == "ram" and again.tokens == cold.tokens
    with Coordinator(RuntimeConfig(devices=("cuda:0",), **base)) as c:
        r = c.generate(prompt, p)
        assert r.cache_tier == "disk" and r.tokens == cold.tokens


def test_batch_on_two_gpus_equals_each_alone(tiny_llama):
    """Continuous batching through batched CUDA graphs, two micro-batches in flight over
    cuda-ipc: each sequence's greedy tokens (float32) equal its tokens run alone."""
    cfg = RuntimeConfig(model=str(tiny_llama), devices=tuple(_gpus()), prefill_chunk=16,
                        max_context=256, dtype="float32", max_seqs=6, draft="none",
                        prefix_cache=False)
    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=24 + i, ignore_eos=True) for i in range(6)]
    with Coordinator(cfg) as c:
        alone = [c.generate(p, sp).tokens for p, sp in zip(prompts, params)]
        got = c.generate_batch(prompts, params)
        assert [r.tokens for r in got] == alone
        assert c.batcher.stats.widest == 3 and c.batcher.stats.most_in_flight >= 2
