"""layersplit: one LLM served with its layers split across processes.

The code lives in top-level source folders (`runtime/`, `shards/`, `ipc/`, `draft/`,
`launch/`); installed, they are `layersplit.runtime`, `layersplit.shards`, ... (pyproject's
`package-dir` mapping), so nothing with a generic name lands in site-packages. Run from a source
tree without installing (PYTHONPATH=the checkout, as bench/device.sh and worktrees do), this
package's search path also covers the checkout's root, so the same `layersplit.X` names resolve
to the same folders.
"""
from __future__ import annotations

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "runtime")) and _os.path.isfile(
        _os.path.join(_root, "runtime", "coordinator.py")):
    __path__.append(_root)  # noqa: F821 - a package's __path__ is defined by the import system

__version__ = "0.1.0"
