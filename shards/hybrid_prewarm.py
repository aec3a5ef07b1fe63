"""fla-core's prefill kernels of a hybrid model compiled ahead, by a process of their own, while
the shard loads its weights and compiles its step graphs.

On a machine's first start (an empty compile cache) the Qwen3.5-27B shape's first request spent
~6 s of its 10.9 s to the first token compiling fla-core's chunked delta rule and causal conv
(Triton; py-spy over `bench/startup.py`, H200, 2026-12-01, with the tuned configs shipped; every
candidate config timed as well where none are). A shard of a range with linear-attention layers
on a GPU starts this process as it starts (`spawn`), unless the compile cache says it was done
for this shape: it builds one `GatedDeltaNet` of the model's shape with random weights on the
same device, runs its prefill forward at `LENGTHS` (the conv's kernel is specialised on a length
divisible by 16 or not), writes its compile cache entry and exits. Triton's cache, which the
two processes share, then holds the kernels, and the shard's first prefill loads them instead of
compiling them. The shard waits for it before it says ready (`finish`, in its warm-up): the
process's time is paid beside the shard's own start, not by the first request.
Only where fla-core's tuned configs ship for the GPU and the shape (`configs_cover`): elsewhere
its kernels would time their candidates beside the shard's own GPU work and keep what they chose,
so the first prefill autotunes them, alone on the GPU, as before. The first step waits for the
process too where no warm-up came. `LAYERSPLIT_HYBRID_PREWARM=0`: no process (the first
request compiles them).

Measured on one H200 (2026-12-01, 93c4173, `STARTUP=hybrid_ab bash bench/device.sh startup`
and a third pair, processes in turn): the Qwen3.5-27B shape's first start, command to first
token, 21.9 s (26.3 / 21.9 / 20.1) against 30.8 s (29.9 / 30.8 / 33.3) without; its first
request's TTFT 1.0 s against 12.0 s. Tried and dropped: the shard's own forward on its layer at
its warm-up (loading the kernels before the first request: ~0.8 s of every start's ready time,
for ~0.1-0.2 s of its first TTFT); fla-core's import in a thread beside the weights' load (the
load then took 4.8 s instead of 0.2, the two threads taking turns on the GIL: no faster).

    python -m layersplit.shards.hybrid_prewarm '{"device": "cuda:0", ...}'   # (`spawn`'s call)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from layersplit.ipc.auth import SECRET_ENV
from layersplit.ipc.parent_watch import watch_parent
from layersplit.shards import compile_cache
from layersplit.shards.kernels import switched_off
from layersplit.shards.kernels.fla_loading import configs_in_force, fla_version
from layersplit.shards.kernels.gated_delta_fla import (
    delta_rules,
    describe,
    fla_switched_off,
    kernel_failure,
)

log = logging.getLogger(__name__)

AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"  # (`runtime.supervisor.compile_cache_env`)
LENGTHS = (64, 37)  # prefill rows run: a multiple of 16 and not (Triton specialises on it)
SWITCH = "LAYERSPLIT_HYBRID_PREWARM"  # 0: no process
WAIT_S = 300.0  # the longest a shard's warm-up waits for the process (an autotune included)


def shape_of(cfg: Any, start: int, end: int, dtype: str) -> dict[str, Any] | None:
    """What the process builds for layers start:end of a model of config `cfg` (a
    `GatedDeltaNet`'s arguments, the run's dtype, whether the shard fuses its projections), or
    None where the range has no linear-attention layer (or SWITCH is off)."""
    from layersplit.shards.fused_hybrid import fuses

    spec = getattr(cfg, "hybrid", None)
    if spec is None or switched_off(SWITCH) or not any(
            spec.is_linear(i) for i in range(start, end)):
        return None
    return {"hidden_size": cfg.hidden_size, "num_k_heads": spec.num_key_heads,
            "num_v_heads": spec.num_value_heads, "head_k_dim": spec.key_head_dim,
            "head_v_dim": spec.value_head_dim, "conv_kernel": spec.conv_kernel,
            "eps": cfg.rms_norm_eps, "fused_projections": spec.fused_projections,
            "dtype": dtype, "fuse": fuses(cfg)}


def configs_cover(folder: Path | None, shape: dict[str, Any]) -> bool:
    """Whether the shipped configs in `folder` (`fla_loading.configs_in_force`) hold this
    shape's heads, widths and dtype: read from the entries of fla-core's chunked output kernel,
    whose autotune key begins with (Hk, Hv, Dk, Dv) and names its tensors' dtypes, q's first."""
    if folder is None:
        return False
    try:
        entries = json.loads((folder / "chunk_fwd_kernel_o.json").read_text())["autotune_entries"]
        heads = [shape["num_k_heads"], shape["num_v_heads"], shape["head_k_dim"],
                 shape["head_v_dim"]]
        dtype = f"torch.{shape['dtype']}"
        return any(e["autotune_key"][:4] == heads and dtype == next(
            (k for k in e["autotune_key"] if str(k).startswith("torch.")), None)
            for e in entries.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _what(shape: dict[str, Any]) -> dict[str, Any]:
    """The compile cache entry that says these kernels were compiled (`CompileCache.lookup`),
    by this fla-core."""
    return {"model": "fla-prefill", "layers": ["", ""], "shape": shape,
            "lengths": list(LENGTHS), "fla": fla_version()}


def _done(shape: dict[str, Any]) -> bool:
    cache = compile_cache.current()
    return cache is not None and cache.lookup(_what(shape)) is not None


def spawn(cfg: Any, start: int, end: int, device: torch.device,
          dtype: str) -> subprocess.Popen | None:
    """Start the process for a shard of layers start:end on `device` (after `use_device`: it
    inherits the compile cache's environment), or None where nothing is to compile: not a GPU,
    fla-core switched off or not installed, no linear-attention layer, no compile cache, or its
    entry there; or where fla-core's configs are not shipped for this GPU (or the user's own
    are set: `fla_loading.configs_in_force`)."""
    if device.type != "cuda" or fla_switched_off() or compile_cache.current() is None:
        return None
    shape = shape_of(cfg, start, end, dtype)
    if shape is None or fla_version() is None or _done(shape):
        return None
    if not configs_cover(configs_in_force(torch.cuda.get_device_name(device)), shape):
        return None  # (fla-core would time its candidates beside the shard's own GPU work, and
        # keep what it chose: the first prefill autotunes, alone on the GPU, as before)
    args = {"device": str(device), "parent_pid": os.getpid(), "shape": shape}
    # (it talks to no one: no secret; and a candidate it timed anyway, for a key the configs
    # lack, is not kept in Triton's cache: timed beside the shard's work)
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, AUTOTUNE_CACHE_ENV)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "layersplit.shards.hybrid_prewarm",
                                 json.dumps(args)], stdin=subprocess.DEVNULL, env=env)
    except OSError as e:  # (the shard compiles them itself, as before)
        log.warning("fla-core's prefill kernels not compiled ahead: %s", e)
        return None
    log.info("fla-core's prefill kernels compiling ahead in process %d", proc.pid)
    return proc


def finish(proc: subprocess.Popen | None, timeout: float = WAIT_S) -> None:
    """Wait for `spawn`'s process (at most `timeout` seconds: then it is ended); its failure is
    logged (the first prefill then compiles what it did not)."""
    if proc is None:
        return
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log.warning("fla-core's prefill kernels: the process compiling them ahead took more "
                    "than %.0f s; ended, the first prefill compiles what it left", timeout)
        return
    if rc != 0:
        log.warning("fla-core's prefill kernels: the process compiling them ahead exited with "
                    "%d (its log says why); the first prefill compiles them", rc)


def stop(proc: subprocess.Popen | None) -> None:
    """End `spawn`'s process if it still runs (the shard closing before its warm-up)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def prewarm_layer(layer: torch.nn.Module, lengths: tuple[int, ...] = LENGTHS) -> None:
    """Run `layer`'s (a `GatedDeltaNet`) prefill forward on random rows at each of `lengths`,
    with states of its own (the layer's weights and any sequence's states are left as they
    were): what a first prefill compiles, compiled (or loaded from Triton's cache) now."""
    w = layer.out_proj.weight
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(1, n, w.shape[0], dtype=w.dtype, device=w.device) * 0.1
            conv_state = torch.zeros(1, *layer.conv_state_shape(), dtype=w.dtype,
                                     device=w.device)
            state = torch.zeros(1, *layer.state_shape(), dtype=torch.float32, device=w.device)
            layer(x, conv_state, state, recurrent=False)
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)


def build_layer(shape: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A `GatedDeltaNet` of `shape` (`shape_of`) with random weights on `device`, its
    projections fused where the shard's are."""
    from layersplit.shards.dtypes import torch_dtype
    from layersplit.shards.layers.gated_delta import GatedDeltaNet

    with torch.device("meta"):  # (no weights until they are in the run's dtype, on device)
        layer = GatedDeltaNet(shape["hidden_size"], shape["num_k_heads"], shape["num_v_heads"],
                              shape["head_k_dim"], shape["head_v_dim"], shape["conv_kernel"],
                              shape["eps"], shape["fused_projections"])
    layer = layer.to(torch_dtype(shape["dtype"])).to_empty(device=device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.0)  # (decays in (0, 1), as a checkpoint's)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.2 if "conv1d" in name else 0.02)
    if shape["fuse"]:
        layer.fuse()
    return layer


def main(argv: list[str]) -> int:
    """The process `spawn` starts: `argv[0]` its JSON arguments (device, parent_pid, shape)."""
    from layersplit.shards.device import use_device

    logging.basicConfig(level=logging.INFO, format="%(asctime)s [prewarm] %(levelname)s "
                        "%(name)s: %(message)s", datefmt="%H:%M:%S")
    args = json.loads(argv[0])
    watch_parent(int(args["parent_pid"]), lambda: None, role="prewarm")
    t0 = time.perf_counter()
    device = use_device(args["device"], None)
    shape = args["shape"]
    prewarm_layer(build_layer(shape, device))
    seconds = time.perf_counter() - t0
    if device.type == "cuda" and (delta_rules(device) is None or kernel_failure() is not None):
        log.warning("fla-core's kernels did not run here (%s): nothing compiled ahead",
                    kernel_failure() or describe(device))
        return 1
    cache = compile_cache.current()
    if cache is not None:
        cache.record(_what(shape), seconds, 0)
    log.info("fla-core's prefill kernels compiled ahead in %.1f s", seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
