"""The batch, the prefix cache and the drafter reach the runtime through the narrow interfaces
they declare (`StepChain`, `CacheHost`, `DraftHost`), not through the coordinator: none of
them imports it, and the coordinator provides every method those interfaces name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from layersplit.runtime import batching, cache_ops, speculative
from layersplit.runtime.coordinator import Coordinator

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["batching", "cache_ops", "speculative"])
def test_no_import_of_the_coordinator(module):
    tree = ast.parse((ROOT / "runtime" / f"{module}.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.endswith("runtime.coordinator")}


@pytest.mark.parametrize("interface", [batching.StepChain, cache_ops.CacheHost,
                                       speculative.DraftHost])
def test_the_coordinator_provides_each_method(interface):
    for name, member in vars(interface).items():
        if name.startswith("_") or not (inspect.isfunction(member) or
                                        isinstance(member, property)):
            continue
        mine = getattr(Coordinator, name, None)
        assert mine is not None, f"Coordinator lacks {interface.__name__}.{name}"
        if inspect.isfunction(member):
            want = list(inspect.signature(member).parameters)
            assert list(inspect.signature(mine).parameters)[:len(want)] == want, name
