"""No module of the package over 800 lines: a file answers one question (a module that grows
past this is split along its seams, as `runtime.coordinator` and `shards.worker` were)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("layersplit", "runtime", "shards", "ipc", "draft", "launch")
MAX_LINES = 800


def test_no_module_over_800_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 50
    over = {p: n for p, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
