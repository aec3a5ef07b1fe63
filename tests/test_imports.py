"""No import circle among the `layersplit.*` modules, counting the imports inside functions and
under TYPE_CHECKING: a lazy import hides a circle from Python, not from a reader. What two
modules both need lives in a module they both import. And the coordinator's side (the CLI, the
server, the coordinator) imports no torch: only the shards need it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the source folders, and the names they are installed under (pyproject's package-dir)
FOLDERS = ("layersplit", "runtime", "shards", "ipc", "draft", "launch")


def modules() -> dict[str, Path]:
    """Every module of the package, by its `layersplit.` name."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "layersplit":
                parts.insert(0, "layersplit")
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The `layersplit` modules `name` imports anywhere in its source (a name imported from a
    module counts as that module, unless it is a submodule)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    out = set()
    for m in found:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m not in (name, "layersplit"):
            out.add(m)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as a path that
    ends where it starts."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # (the graph is a few hundred modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}  # a shortest way from `start` to each module of the group
        frontier = [start]
        while not any(start in graph[v] for v in frontier):  # (the group is strongly connected)
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        back = next(v for v in frontier if start in graph[v])
        out.append(paths[back] + [start])
    return out


def test_the_scan_sees_lazy_imports(tmp_path):
    """The scan counts an import inside a function (the kind that hid the circles), and names
    a circle it finds."""
    known = {"layersplit.a": tmp_path / "a.py", "layersplit.b": tmp_path / "b.py"}
    known["layersplit.a"].write_text("def f():\n    from layersplit.b import g\n")
    assert imports_of("layersplit.a", known["layersplit.a"], known) == {"layersplit.b"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    known = modules()
    assert "layersplit.runtime.coordinator" in known and "layersplit.shards.worker" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


# the floors: a module imports only from its own folder and those below it
BELOW = {"launch": {"launch", "runtime", "shards", "draft", "ipc"},
         "runtime": {"runtime", "shards", "draft", "ipc"},
         "draft": {"draft", "shards", "ipc"},  # (a process like a shard, beside them)
         "shards": {"shards", "ipc"}, "ipc": {"ipc"}}
# the zygote forks the shard and draft processes, whose entry point is the CLI's
UPWARD = {("layersplit.runtime.zygote", "layersplit.launch.processes")}


def test_each_folder_imports_only_from_below():
    """launch -> runtime -> (shards, draft) -> ipc: the draft process depends on the shards'
    layers and the channels, not on the coordinator's side (the runtime reaches it through
    messages); the shards know nothing of the runtime."""
    known = modules()
    up = []
    for name, path in known.items():
        folder = name.split(".")[1] if name.count(".") else ""
        for m in imports_of(name, path, known):
            target = m.split(".")[1] if m.count(".") else ""
            if folder in BELOW and target in FOLDERS and target not in BELOW[folder] and \
                    (name, m) not in UPWARD:
                up.append(f"{name} -> {m}")
    assert not up, "imports from a folder above: " + "; ".join(sorted(up))


def test_the_coordinator_imports_no_torch():
    """Importing torch costs a process ~2.5 s of CPU; every shard pays it (in its zygote), the
    coordinator need not: it moves token ids and logits as numpy arrays (`ipc.transport`). Nor
    does reading a draft's taps before the shards start (on a GPU host that import was ~1.4 s
    of every start)."""
    code = ("import sys\n"
            "import layersplit.launch.cli, layersplit.runtime.coordinator\n"
            "import layersplit.runtime.server, layersplit.runtime.grammar\n"
            # (what the coordinator reads of a draft before its shards start: its taps)
            "from layersplit.runtime.model_store import BUNDLED_DRAFT\n"
            "from layersplit.runtime.speculative import draft_taps\n"
            "assert draft_taps(BUNDLED_DRAFT)\n"
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", "the coordinator's side imports " + out.stdout
