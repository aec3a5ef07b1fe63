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

Only the delta rule moves to fla: its causal conv keeps a state of the kernel's full width
(ours, transformers' and the prefix cache's hold the last K - 1 inputs) and the depthwise conv
is a small part of a layer's time. The verify rows of speculative decoding run one-token steps,
so they use the fused recurrent kernel too.

`LAYERSPLIT_FLA=0` keeps the torch path on CUDA. Why fla is not used (off, not installed, its
import or a kernel call failed) is logged once, at WARNING on a CUDA device.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "LAYERSPLIT_FLA"
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def _load_fla() -> tuple[tuple[Rule, Rule] | None, str]:
    """(fla's (chunked, recurrent) rules wrapped to our signature, or None; what was used or
    why not)."""
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
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

    from importlib.metadata import PackageNotFoundError, version

    try:
        which = f"fla-core {version('fla-core')}"
    except PackageNotFoundError:
        which = "fla (flash-linear-attention)"
    return (wrap(chunk_gated_delta_rule), wrap(fused_recurrent_gated_delta_rule)), which


_broken: list[str] = []  # why a kernel call failed: the torch path runs from then on


def kernel_failure() -> str | None:
    """Why an fla-core kernel call failed in this process (the torch path runs since), or
    None."""
    return _broken[0] if _broken else None


def fla_switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


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
    fla = rules[1] if recurrent else rules[0]

    def guarded(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return fla(*args)
        except Exception as e:  # noqa: BLE001 - any kernel failure: the exact path instead
            _broken.append(f"{type(e).__name__}: {e}")
            log.warning("fla-core's gated delta rule failed (%s); the torch path runs from "
                        "now on", _broken[0])
            return torch_rule(*args)

    return guarded


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
