"""Helpers for multi-process tests: traces of logits, leak checks."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import torch
from layersplit.runtime.generate import GenerationResult, Progress, collect
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fp8 import dequantize_fp8, quantize_fp8
from layersplit.shards.sampling import SamplingParams
from safetensors.torch import load_file, save_file

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def trace(engine, prompt: list[int], steps: int, chunk: int, turn_end_ids=(2,)):
    """Greedy-run `engine` (reference or coordinator) and return (tokens, logits per step)."""
    logits, tokens = [], []
    out = None
    for a, b in prefill_chunks(prompt, 0, len(prompt), chunk, turn_end_ids):
        out = engine.forward(prompt[a:b], a, GREEDY, 0, want_logits=True)
        logits.append(out.logits)
    tok, pos = out.token, len(prompt)
    for _ in range(steps):
        tokens.append(tok)
        out = engine.forward([tok], pos, GREEDY, 0, want_logits=True)
        logits.append(out.logits)
        tok, pos = out.token, pos + 1
    return tokens, np.stack(logits)


def run_logged(engine, prompt: list[int],
               params: SamplingParams) -> tuple[GenerationResult, np.ndarray]:
    """Generate with `engine` (reference or coordinator) through the whole generation loop and
    return the result and the logits each token was drawn from (one row per token)."""
    progress = Progress(logits=[])
    result = collect(engine.stream(prompt, params, progress), progress, len(prompt))
    return result, np.stack(progress.logits)


def run_speculated(coord, prompt: list[int], params: SamplingParams,
                   **kw) -> tuple[GenerationResult, np.ndarray, object]:
    """Generate with a coordinator whose draft serves (no prefix cache unless `kw` says so)
    and return the result, the logits each token was drawn from (a speculated token's come
    from its verify row) and the request's speculation statistics (`SpecStats`)."""
    progress = Progress(logits=[])
    kw.setdefault("use_cache", False)
    result = collect(coord.stream(prompt, params, progress, **kw), progress, len(prompt))
    return result, np.stack(progress.logits), progress.spec


def oracle_acceptance(coord, prompts: list[list[int]], plain: list[list[int]],
                      params: SamplingParams) -> float:
    """Speculate each prompt with the bench oracle's draft, check its tokens equal plain
    decoding's (`plain`), and return the tokens a verify step committed on average."""
    committed = verifies = 0
    for p, want in zip(prompts, plain):
        progress = Progress()
        got = collect(coord.stream(p, params, progress, use_cache=False), progress, len(p))
        assert got.tokens == want
        committed += progress.spec.committed
        verifies += progress.spec.verifies
    return committed / verifies


def assert_speculated_equals(coord, prompt: list[int], params: SamplingParams,
                             want: tuple[GenerationResult, np.ndarray], what: str = ""):
    """A speculated run's tokens and the logits of every position it emitted (accepted draft
    tokens and bonus tokens alike) equal `want` (the reference's plain run, `run_logged`) bit
    for bit; verify steps ran. Returns its `SpecStats`."""
    result, logits, spec = run_speculated(coord, prompt, params)
    assert_same_run((result, logits), want, what)
    assert spec is not None and spec.verifies > 0, f"{what}: no verify step ran"
    return spec


def write_fp8(dense: Path, out: Path, block: tuple[int, int] = (16, 32)) -> Path:
    """`dense` (an HF folder) written as an FP8 checkpoint at `out` (every 2-D `*_proj.weight`
    in float8 e4m3 with block scales, `shards.fp8`), and `dense` itself rewritten with the
    dequantized values: the two then hold the same model."""
    shutil.copytree(dense, out)
    for f in sorted(dense.glob("*.safetensors")):
        tensors, fp8 = load_file(str(f)), {}
        for name, t in list(tensors.items()):
            if name.endswith("_proj.weight") and t.dim() == 2:
                q, s = quantize_fp8(t, block)
                fp8[name], fp8[name + "_scale_inv"] = q, s
                tensors[name] = dequantize_fp8(q, s, block, t.dtype)
        save_file(tensors, str(f))
        save_file({**tensors, **fp8}, str(out / f.name))
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(raw))
    return out


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i of a word holds column 8c + this


def pack_rows(q: np.ndarray) -> np.ndarray:
    """GPTQ's qweight: (K, N) values 0..15 -> (K/8, N) int32, row 8r + i in bits 4i..4i+3 of
    word r."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint32)
    for i in range(8):
        words |= q[i::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_cols(q: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """(R, C) values 0..15 -> (R, C/8) int32, nibble i of word c holding column 8c + order[i]
    (GPTQ's qzeros: in order; AWQ's qweight and qzeros: `AWQ_ORDER`)."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        words |= q[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def write_int4(dense: Path, out: Path, method: str, group: int = 32,
               act_order: bool = False) -> Path:
    """`dense` (an HF folder) written as a GPTQ (v1) or AWQ (GEMM) int4 checkpoint at `out`
    (every 2-D `*_proj.weight` rounded to 4 bits with a float16 scale and a zero per group of
    `group` input rows, -1: all, asymmetric), and `dense` itself rewritten with the dequantized
    values: the two then hold the same model. `act_order`: GPTQ's groups over a seeded
    permutation of the input rows (`g_idx`, as desc_act stores them), one per input width (as
    GPTQ's order comes from the input, which q/k/v share, as gate/up do)."""
    shutil.copytree(dense, out)
    rng = np.random.default_rng(0)
    perms: dict[int, np.ndarray] = {}
    for f in sorted(dense.glob("*.safetensors")):
        tensors, packed = load_file(str(f)), {}
        for name, t in list(tensors.items()):
            if not (name.endswith("_proj.weight") and t.dim() == 2):
                continue
            w = t.double().numpy().T  # (K, N): in, out
            k = w.shape[0]
            rows = k if group == -1 else group
            g_idx = np.arange(k) // rows
            if act_order:
                if k not in perms:
                    perms[k] = rng.permutation(k)
                g_idx[perms[k]] = np.arange(k) // rows
            lo = np.stack([w[g_idx == g].min(0) for g in range(k // rows)])
            hi = np.stack([w[g_idx == g].max(0) for g in range(k // rows)])
            scale = np.maximum((hi - lo) / 15, 1e-3).astype(np.float16)
            s = scale.astype(np.float64)
            zero = np.clip(np.round(-lo / s), 1 if method == "gptq" else 0, 15).astype(np.int64)
            q = np.clip(np.round(w / s[g_idx] + zero[g_idx]), 0, 15).astype(np.int64)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(
                ((q - zero[g_idx]) * s[g_idx]).T.astype(np.float32)))
            prefix = name.removesuffix(".weight")
            if method == "gptq":  # (v1: the zeros stored one less)
                parts = {"qweight": pack_rows(q), "qzeros": pack_cols(zero - 1),
                         "g_idx": g_idx.astype(np.int32)}
            else:
                parts = {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(zero, AWQ_ORDER)}
            parts["scales"] = scale
            packed.update({f"{prefix}.{p}": torch.from_numpy(np.ascontiguousarray(v))
                           for p, v in parts.items()})
        save_file(tensors, str(f))
        kept = {n: t for n, t in tensors.items()
                if n.removesuffix(".weight") + ".qweight" not in packed}
        save_file({**kept, **packed}, str(out / f.name))
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                 "sym": False, "checkpoint_format": "gptq", "damp_percent": 0.01,
                 "true_sequential": True, "static_groups": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}}[method]
    (out / "config.json").write_text(json.dumps(raw))
    return out


def range_logits(folder: Path, ids, split: tuple[int, ...] | None = None,
                 weights: str = "dequantize"):
    """The logits of every position of `ids` through the checkpoint at `folder`, loaded range
    by range at `split` (layer bounds; None: whole) and run in this process."""
    ckpt = open_checkpoint(folder)
    n = ckpt.config.num_layers
    split = split or (0, n)
    parts = [RangeExecutor(load_layer_range(ckpt, a, b, weights=weights), max_len=64)
             for a, b in zip(split[:-1], split[1:])]
    x = ids
    for p in parts:
        x = p.run(x, 0, all_logits=True)
    return x


def noisy_copy(src: Path, dst: Path, scale: float = 0.01, only: set[str] | None = None) -> Path:
    """A classic draft for the checkpoint `src`: a copy with seeded noise on its weights (it
    agrees with the target often, not always, so verify steps keep some draft tokens and
    reject others); `only`: on these tensors alone."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(1)
    state = {k: v + scale * torch.randn(v.shape, generator=g) if only is None or k in only else v
             for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def drive(coord, reqs: list) -> None:
    """Run a coordinator's batch until every request submitted to it (`Coordinator.submit`)
    is done; none may have failed."""
    while not all(r.done for r in reqs):
        coord.batcher.run_once()
    for r in reqs:
        assert r.error is None, r.error


def assert_same_run(got: tuple[GenerationResult, np.ndarray],
                    want: tuple[GenerationResult, np.ndarray], what: str = "") -> None:
    """The same tokens, and bit-identical logits at every generated position."""
    (r, logits), (w, want_logits) = got, want
    assert r.tokens == w.tokens, f"{what}: tokens {r.tokens} != {w.tokens}"
    assert_same_logits(logits, want_logits, what)


def assert_same_logits(logits: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert logits.shape == want.shape, f"{what}: logits {logits.shape} != {want.shape}"
    bad = [i for i in range(len(want)) if not np.array_equal(logits[i], want[i])]
    assert not bad, (f"{what}: logits differ at generated positions {bad} (max "
                     f"{np.abs(logits[bad[0]] - want[bad[0]]).max():.3e} at {bad[0]})")


def send_raw_step(coord, seqs: list[dict], ids: list[int], **extra) -> int:
    """A step message built by hand (`extra`: more of its fields), sent where the
    coordinator's steps go (the first shard's ring or socket) and not tracked as in flight;
    returns its sid (`coord._wait` on it)."""
    import torch
    from layersplit.ipc.messages import message

    sid = coord._new_sid()
    coord._steps.send(message("step", sid=sid, seqs=seqs, act=None, **extra),
                      torch.tensor(ids, dtype=torch.int64))
    return sid


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """`layersplit ARGV` run in this process (`launch.cli.main`), as `subprocess.run(...,
    capture_output=True, text=True)` would report it: the real command, whose CPU shards fork
    from this process's zygote, without a fresh interpreter that imports torch and starts a
    zygote of its own (~5 s of CPU a run). For what needs no process of its own: a command
    whose signals, exit or environment a test looks at runs as a subprocess. What the command
    logs goes to its stderr, as in a process of its own; the signal handlers and logging it
    sets up are put back."""
    from layersplit.launch.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sigterm = signal.getsignal(signal.SIGTERM)
    # (files, not StringIO: the command registers its stack dump on SIGUSR1 to stderr's fd)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(list(argv))
                except SystemExit as e:  # (argparse's errors)
                    rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                    if isinstance(e.code, str):
                        err.write(e.code + "\n")
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
            signal.signal(signal.SIGTERM, sigterm)
            faulthandler.unregister(signal.SIGUSR1)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["layersplit", *argv], rc, out.read(), err.read())


def layersplit_shm() -> set[str]:
    """Our shared-memory segments in /dev/shm (`ipc.shm`: `layersplit-<creator pid>-*`): those
    of this process and its descendants, and those whose creator is gone (a leak). Not those of
    other live processes: another test run on the machine creates segments that live for a
    moment (until its peer maps them), and a check of ours must not count them."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    names = set()
    for p in Path("/dev/shm").glob("layersplit-*"):
        pid = p.name.split("-")[1]
        if not pid.isdigit() or int(pid) in ours or not psutil.pid_exists(int(pid)):
            names.add(p.name)
    return names


def shard_children(pid: int | None = None) -> list[psutil.Process]:
    """Live shard (and draft) processes started by `pid` (default: this process): spawned ones
    (`python -m layersplit.launch.cli ...`) and those forked from a zygote (`runtime.zygote`;
    their command line is the zygote's), not the zygote itself."""
    try:
        kids = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            forked = k.ppid() != k.pid and "runtime.zygote" in " ".join(
                psutil.Process(k.ppid()).cmdline()) and \
                "runtime.zygote" in " ".join(k.cmdline())
            if ("launch.cli" in " ".join(k.cmdline()) or forked) and \
                    k.status() != psutil.STATUS_ZOMBIE:
                out.append(k)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive (zombies count as gone) after at most `timeout` s."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while True:
        alive = [p for p in alive if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def busy_load(n: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """`n` (default: twice the cores) busy-looping processes for the duration: a loaded machine."""
    n = n or 2 * (os.cpu_count() or 1)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def token_ids(n: int, seed: int = 1) -> torch.Tensor:
    """n seeded random token ids below 320 (the tiny test models' vocabularies)."""
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


class CpuGraph:
    """`cpu_capture`'s stand-in for a captured CUDA graph: a replay runs the step again and
    copies its outputs (and tapped rows) into the ones the capture returned."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new, taps = self.fn()
        self.out[0].copy_(new)
        for k, v in taps.items():
            if v is not None:
                self.out[1][k].copy_(v)


def cpu_capture(fn, pool):
    """A CPU stand-in for `shards.graphs.capture` (monkeypatched in): two warm-up runs, then the
    recorded call run too (a real capture records it without running it), so the paths
    `StaticDecoder` takes on a GPU run on the CPU."""
    fn()
    fn()
    out = fn()
    return CpuGraph(fn, out), out


def step_rows(model, n: int, seed: int) -> torch.Tensor:
    """Seeded input of an n-row step of a layer range: token ids on the first range, else
    hidden rows."""
    g = torch.Generator().manual_seed(seed)
    if model.is_first:
        return torch.randint(3, 300, (n,), generator=g)
    return torch.randn(n, model.cfg.hidden_size, generator=g)


def close_rel(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    """`a` has `b`'s shape and is within `tol` of `b`'s largest magnitude (at least 1)."""
    return a.shape == b.shape and \
        float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
