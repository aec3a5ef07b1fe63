"""The gated delta rule on CUDA with fla-core's Triton kernels (flash-linear-attention's core,
PyPI `fla-core`, module `fla`), where installed; else the exact torch path of
`shards.layers.gated_delta`, which stays the reference on every device.

`delta_rules(device)` gives the (chunked, recurrent) pair a `GatedDeltaNet` runs, both with the
torch functions' signature: `(q, k, v, g, beta, state) -> (out, final state)`, q/k (B, n, Hk,
Dk) un-normalised, v (B, n, Hv, Dv), g and beta (B, n, Hv), state (B, Hv, Dk, Dv) float32.
fla-core computes the same thing (`chunk_gated_delta_rule` in prefill chunks,
`fused_recurrent_gated_delta_rule` in one-token steps): q/k L2-normed in the kernel (eps 1e-6),
q scaled by Dk ** -0.5, value head h reading key head h // (Hv / Hk) (grouped, as here), the
state in the same (Hv, Dk, Dv) layout, float32. Its numbers differ from the torch path's by
rounding only (`tests/shards/test_hybrid_gpu.py`).

A prefill chunk's causal depthwise conv (with its SiLU) runs fla-core's Triton
`causal_conv1d` too (`pick_conv`): it reads the (B, n, C) rows where the projection left them,
where the torch path transposes them into one (B, C, K - 1 + n) copy beside the state and runs
a depthwise conv then a SiLU, about 1.8 ms a layer at 8K tokens of the Qwen3.5-27B shape on an
H100, 9 % of the prefill (2026-11-26). fla's state is the kernel's full width K (its
first column unread); ours, transformers' and the prefix cache's hold the last K - 1 inputs, so
the state goes in with a zero column in front and comes out without its first. It sums in
float32 and rounds once, after the SiLU (the torch path rounds the conv's output first).
One-token steps keep the torch form (`shards.fused_hybrid` captures it in the step's graph).
A chain's verify step runs our own kernel (`shards.kernels.gated_delta_rows`: fla's keeps the
last row's state only); row by row (trees, deterministic mode) each row is a one-token step.

`LAYERSPLIT_FLA=0` keeps the torch path on CUDA (delta rule and conv). Why fla is not used
(off, not installed, its import or a kernel call failed) is logged once, at WARNING on a CUDA
device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import switched_off
from layersplit.shards.kernels.fla_loading import fla_version, import_fla, tuned_configs

log = logging.getLogger(__name__)

ENV_SWITCH = "LAYERSPLIT_FLA"
# the modules fla-core 0.6's `causal_conv1d` imports inside each call (its circular imports)
CONV_CALL_IMPORTS = ("fla.modules.causal_conv1d.backends.cuda", "fla.modules.causal_conv1d.cp")
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Conv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


_devices: list[torch.device] = []  # the first CUDA device fla-core was asked for (`delta_rules`)


def _gpu_name() -> str:
    """The model name of the CUDA device fla-core's kernels run on (whose tuned configs
    `fla_loading` ships): the first one `delta_rules` was asked for, else the current one."""
    try:
        return torch.cuda.get_device_name(_devices[0] if _devices else
                                           torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no device to name: no shipped configs
        return ""


@functools.cache
def _load_fla() -> tuple[tuple[Rule, Rule] | None, str]:
    """(fla's (chunked, recurrent) rules wrapped to our signature, or None; what was used or
    why not)."""
    try:
        with tuned_configs(_gpu_name()) as configs:
            (gdr,) = import_fla("fla.ops.gated_delta_rule")
        chunk_gated_delta_rule = gdr.chunk_gated_delta_rule
        fused_recurrent_gated_delta_rule = gdr.fused_recurrent_gated_delta_rule
    except ImportError as e:
        return None, (f"fla-core is not installed ({e}); pip install fla-core (the 'cuda' "
                      "extra) for its Triton kernels")
    except Exception as e:  # noqa: BLE001 - a broken install (Triton mismatch...): say which
        return None, f"fla-core failed to import ({type(e).__name__}: {e})"

    def wrap(kernel) -> Rule:
        def rule(q, k, v, g, beta, state):
            # (the kernels index [B, T, H, D] rows densely: q/k/v are views of the conv output)
            out, final = kernel(
                q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                beta=beta.to(q.dtype).contiguous(), initial_state=state.float(),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
            return out.to(v.dtype), final
        return rule

    installed = fla_version()
    which = "fla (flash-linear-attention)" if installed is None else f"fla-core {installed}"
    if configs is not None:
        which += f", tuned configs shipped for this GPU ({configs.name})"
    return (wrap(chunk_gated_delta_rule), wrap(fused_recurrent_gated_delta_rule)), which


@functools.cache
def _load_fla_conv() -> Conv | None:
    """fla's causal conv (with SiLU) wrapped to `causal_conv`'s signature, or None where its
    module is missing (an fla-core without it: the torch conv runs)."""
    try:
        with tuned_configs(_gpu_name()):
            (mod,) = import_fla("fla.modules.causal_conv1d")
            for lazy in CONV_CALL_IMPORTS:  # (loaded now, not in the first prefill)
                try:
                    import_fla(lazy)
                except Exception as e:  # noqa: BLE001 - the call imports it, or fails, itself
                    log.debug("fla-core: %s not preloaded (%s)", lazy, e)
        causal_conv1d = mod.causal_conv1d
    except Exception as e:  # noqa: BLE001 - missing or broken: the torch conv, said once
        log.warning("causal conv on CUDA: the torch path runs, not fla-core's kernel: its "
                    "causal_conv1d failed to import (%s: %s)", type(e).__name__, e)
        return None

    def conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # x (B, n, C) (a view of the projection's output: its row stride is passed through),
        # state (B, C, K - 1) -> fla's (B, C, K), whose first column it never reads
        full_width = F.pad(state.to(x.dtype), (1, 0)).contiguous()
        out, final = causal_conv1d(x, weight.contiguous(), initial_state=full_width,
                                   output_final_state=True, activation="silu")
        return out, final[:, :, 1:]
    return conv


_broken: list[str] = []  # why a kernel call failed: the torch path runs from then on


def kernel_failure() -> str | None:
    """Why an fla-core kernel call failed in this process (the torch path runs since), or
    None."""
    return _broken[0] if _broken else None


def fla_switched_off() -> bool:
    return switched_off(ENV_SWITCH)


def delta_rules(device: torch.device | str) -> tuple[Rule, Rule] | None:
    """fla-core's (chunked, recurrent) rules for tensors on `device`, or None where the torch
    path runs (not CUDA, switched off, fla-core missing or broken)."""
    if torch.device(device).type != "cuda":
        return None
    if fla_switched_off():
        _note(f"{ENV_SWITCH}=0")
        return None
    if _broken:
        return None
    if not _devices:
        _devices.append(torch.device(device))
    rules, why = _load_fla()
    _note(why if rules is None else None)
    return rules


def pick_rule(device: torch.device | str, recurrent: bool, torch_rule: Rule) -> Rule:
    """The rule a step on `device` runs: fla-core's chunked or recurrent one where it runs,
    else `torch_rule`. A failing kernel call (a Triton compile or launch error for these shapes)
    is logged and answered by `torch_rule`, which runs from then on (the kernels leave their
    inputs, the state included, as they were)."""
    rules = delta_rules(device)
    if rules is None:
        return torch_rule
    return guarded(rules[1] if recurrent else rules[0], torch_rule,
                   "fla-core's gated delta rule", _broken)


def pick_conv(device: torch.device | str, torch_conv: Conv) -> Conv:
    """The causal conv + SiLU a prefill chunk on `device` runs: fla-core's where its delta
    rule runs (and its conv imports), else `torch_conv`; a failing call is answered as in
    `pick_rule` (the conv writes nothing in place: the caller stores the state it returns)."""
    fla = _load_fla_conv() if delta_rules(device) is not None else None
    return torch_conv if fla is None else guarded(fla, torch_conv, "fla-core's causal conv",
                                                  _broken)


def guarded(kernel: Callable, torch_fn: Callable, what: str, broken: list[str]) -> Callable:
    """`kernel`, answered by `torch_fn` on its first failure and from then on: the failure is
    logged (`what` failed) and recorded in `broken`, which every kernel sharing it reads. Out
    of memory, or a failure inside a graph capture (whose caller runs the step eager, and this
    kernel again), is raised instead: not the kernel's failing."""

    def call(*args: torch.Tensor) -> Any:
        if broken:
            return torch_fn(*args)
        try:
            return kernel(*args)
        except Exception as e:  # noqa: BLE001 - any kernel failure: the exact path instead
            if isinstance(e, torch.OutOfMemoryError) or (
                    torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                raise
            broken.append(f"{type(e).__name__}: {e}")
            log.warning("%s failed (%s); the torch path runs from now on", what, broken[0])
            return torch_fn(*args)

    return call


def describe(device: torch.device | str) -> str:
    """Which gated delta rule runs on `device` (for the shard's start-up log)."""
    if delta_rules(device) is not None:
        return f"{_load_fla()[1]} Triton kernels"
    if torch.device(device).type != "cuda":
        return "the torch path"
    why = (f"{ENV_SWITCH}=0" if fla_switched_off() else
           f"fla-core failed: {_broken[0]}" if _broken else _load_fla()[1])
    return f"the torch path ({why})"


@functools.cache
def _note(why: str | None) -> None:
    """Log, once per reason, that the torch path runs on a CUDA device."""
    if why is not None:
        log.warning("gated delta rule on CUDA: the torch path runs, not fla-core's kernels: %s",
                    why)
