"""Programmatic dependent launch (`shards.kernels.pdl`): where it is on, and the rule that keeps
a chain of kernels ordered under it. A kernel launched with PDL may start while the kernel
before it runs, so each must wait first, in every program, before touching memory: a kernel that
read before its wait would read its input early, and one that never waited could finish before
its predecessor and release the kernel after both too soon. Checked here on the source, so on
every host (the kernels themselves run on GPUs: `tests/gpu/test_pdl.py`)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from layersplit.shards import kernels

KERNELS = Path(kernels.__file__).parent


def _jit_kernels() -> dict[str, ast.FunctionDef]:
    """Every @triton.jit function of shards/kernels, by module and name ("gemv._gemv")."""
    out: dict[str, ast.FunctionDef] = {}
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                out[f"{path.stem}.{node.name}"] = node
    return out


def _launched(fns: dict[str, ast.FunctionDef], module: str, name: str) -> str | None:
    """The kernel `name` launched in `module`: its own, else the one other module's of that
    name (imported); None where `name` is no kernel."""
    if f"{module}.{name}" in fns:
        return f"{module}.{name}"
    others = [key for key in fns if key.endswith(f".{name}")]
    assert len(others) <= 1, f"{module} launches {name}, defined in several modules: {others}"
    return others[0] if others else None


def _takes_pdl(fn: ast.FunctionDef) -> bool:
    return any(a.arg == "PDL" for a in fn.args.args)


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # (the docstring)
    return body[0]


def test_every_pdl_kernel_waits_before_anything_else():
    fns = _jit_kernels()
    taking = {key.split(".")[1] for key, fn in fns.items()
              if _takes_pdl(fn) and key != "pdl.pdl_start"}
    # the decode step's kernels: projections, norms, experts and routing, attention of each kind
    assert {"_gemv", "_gemm_rows", "_add_rms_norm", "_rope_qk", "_gate_up_act", "_down",
            "_route_grouped", "_attend", "_combine", "_mla_attend", "_mla_rows",
            "_heads_matmul", "_recurrent_rows", "_planar_gemv"} <= taking
    for key in sorted(k for k, fn in fns.items() if _takes_pdl(fn) and k != "pdl.pdl_start"):
        name, first = key, _first_statement(fns[key])
        assert ast.unparse(first) == "pdl_start(PDL)", (
            f"{name} takes PDL but its first statement is `{ast.unparse(first)}`, not "
            f"`pdl_start(PDL)`: under PDL it could touch memory before the kernel before it ends")


def test_every_launch_of_a_pdl_kernel_passes_it_and_no_other_does():
    fns = _jit_kernels()
    launches = 0
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and
                    isinstance(node.func.value, ast.Name)):
                continue
            name = _launched(fns, path.stem, node.func.value.id)
            if name is None:
                continue
            passes = [k for k in node.keywords if k.arg is None and
                      isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl"]
            where = f"{path.name}:{node.lineno}"
            if _takes_pdl(fns[name]):
                launches += 1
                assert len(passes) == 1, f"{where}: {name} is launched without **pdl(...)"
                assert not any(k.arg in ("PDL", "launch_pdl") for k in node.keywords), where
            else:
                assert not passes, f"{where}: {name} gets **pdl(...) but does not wait first"
    assert launches >= 20  # (every launch site of the kernels above was seen)


def test_pdl_is_off_off_cuda_and_by_its_switch(monkeypatch):
    assert not kernels.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(kernels, "_device_pdl", lambda index: index == 0)
    monkeypatch.delenv(kernels.PDL_SWITCH, raising=False)
    assert kernels.pdl_enabled(torch.device("cuda", 0))
    assert not kernels.pdl_enabled(torch.device("cuda", 1))  # (a GPU before Hopper)
    for off in ("0", "off", "false", "no"):
        monkeypatch.setenv(kernels.PDL_SWITCH, off)
        assert not kernels.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv(kernels.PDL_SWITCH, "1")
    assert kernels.pdl_enabled(torch.device("cuda", 0))
