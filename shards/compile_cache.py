"""The compile cache of a shard or draft process: Triton's and torch inductor's on-disk caches
(compiled kernels, autotuning results) under `$LAYERSPLIT_HOME/compile/<key>/`, one directory per
key, and our record of what a warm-up filled it with.

The key is what makes a compiled kernel or an autotuning choice reusable: the versions of torch,
Triton and CUDA (or ROCm) and the device's model (a GPU's name and compute capability). The
coordinator's launcher names the root (`ROOT_ENV`, `runtime.supervisor.compile_cache_env`); each
process computes its key itself, before anything compiles (`use`), because only it sees its
device. A user's own `TRITON_CACHE_DIR` / `TORCHINDUCTOR_CACHE_DIR` win.

What is ours in a key's directory, and checked when a process starts:
- `manifest.json`: the key's versions and a checksum. Unreadable, with a wrong checksum, or naming
  other versions than the key's (a directory copied from another machine): the directory is
  stale; it is emptied, with a warning naming it, and filled again.
- `entries/<name>.json`: one per warm-up of one layer range (`Entry`): what it warmed (model,
  layers, dtype, step shapes), how long the first one took (the next start's estimate), and a
  checksum. A corrupt or stale entry is removed with a warning naming it, and rebuilt by the
  warm-up that follows; a valid one is reused (not rewritten).
- Triton's autotuning results (`*.autotune.json`, written by Triton under
  `TRITON_CACHE_AUTOTUNING`): Triton fails a kernel's launch on one it cannot parse, so a start
  removes those with a warning naming each. Triton's and inductor's other files are theirs to
  check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ROOT_ENV = "LAYERSPLIT_COMPILE_CACHE"  # the root the launcher chose (a process's key dir in it)
FORMAT = 1
MANIFEST = "manifest.json"


def versions(device: str) -> dict[str, str]:
    """What a compiled kernel depends on, for `device` (`cpu`, `cuda:N`)."""
    import torch

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "none"
    out = {"torch": torch.__version__, "triton": triton,
           "cuda": torch.version.cuda or (f"hip{torch.version.hip}" if torch.version.hip
                                          else "none")}
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        out["device"] = f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    else:
        out["device"] = f"cpu {platform.machine()}"
    return out


def key_name(v: dict[str, str]) -> str:
    """A key's directory name: readable (device, torch, Triton, CUDA) and a short hash of all."""
    digest = hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:8]
    text = f"{v['device']}-torch{v['torch']}-triton{v['triton']}-cuda{v['cuda']}"
    return f"{re.sub(r'[^A-Za-z0-9.+]+', '_', text)}-{digest}"


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_json(path: Path, body: dict[str, Any]) -> None:
    """`body` with its checksum, atomically (another process may read it meanwhile)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**body, "sha256": _checksum(body)}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(body, "") of a file `_write_json` wrote, or (None, why it cannot be used)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("sha256"), str):
        return None, "no checksum"
    body = {k: v for k, v in data.items() if k != "sha256"}
    if _checksum(body) != data["sha256"]:
        return None, "checksum mismatch"
    return body, ""


class CompileCache:
    """One key's directory (`key_dir`) for a process with versions `v`."""

    def __init__(self, key_dir: Path, v: dict[str, str]) -> None:
        self.dir, self.versions = key_dir, v
        self.entries = key_dir / "entries"

    @classmethod
    def open(cls, root: Path, v: dict[str, str]) -> CompileCache:
        """The key's directory under `root`, made (0700) and checked (see the module doc)."""
        cache = cls(root / key_name(v), v)
        cache.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache.entries.mkdir(mode=0o700, exist_ok=True)
        cache._check_manifest()
        cache._check_autotune_results()
        return cache

    def _check_manifest(self) -> None:
        path = self.dir / MANIFEST
        if not path.exists():
            _write_json(path, {"format": FORMAT, "versions": self.versions,
                               "created": time.time()})
            return
        body, why = _read_json(path)
        if body is not None and body.get("versions") != self.versions:
            why = f"stale (written for {body.get('versions')})"
        elif body is not None and body.get("format") != FORMAT:
            why = f"format {body.get('format')!r}, not {FORMAT}"
        if not why:
            return
        log.warning("compile cache %s: %s: %s; emptied and rebuilt", self.dir, path.name, why)
        for child in self.dir.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()
        self.entries.mkdir(mode=0o700, exist_ok=True)
        _write_json(path, {"format": FORMAT, "versions": self.versions, "created": time.time()})

    def _check_autotune_results(self) -> None:
        triton = self.dir / "triton"
        if not triton.is_dir():
            return
        for path in triton.glob("*/*.autotune.json"):
            try:
                json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as e:
                log.warning("compile cache: Triton autotuning result %s is unreadable (%s); "
                            "removed, its kernel is tuned again", path, type(e).__name__)
                with contextlib.suppress(OSError):
                    path.unlink()

    def env(self) -> dict[str, str]:
        """Triton's and inductor's cache directories in this key's directory."""
        return {"TRITON_CACHE_DIR": str(self.dir / "triton"),
                "TORCHINDUCTOR_CACHE_DIR": str(self.dir / "inductor")}

    # ---- entries --------------------------------------------------------------------------------
    def entry_path(self, what: dict[str, Any]) -> Path:
        """The entry of one warm-up, `what` it warms (model, layers, dtype, step shapes...)."""
        model = re.sub(r"[^A-Za-z0-9.+]+", "_", Path(str(what.get("model", "model"))).name)
        layers = what.get("layers", ("", ""))
        digest = _checksum(what)[:12]
        return self.entries / f"{model[:40]}-L{layers[0]}-{layers[1]}-{digest}.json"

    def lookup(self, what: dict[str, Any]) -> dict[str, Any] | None:
        """The valid entry for `what`, or None (a corrupt or stale one removed, with a warning
        naming it: the warm-up that follows writes it again)."""
        path = self.entry_path(what)
        if not path.exists():
            return None
        body, why = _read_json(path)
        if body is not None and (body.get("versions") != self.versions
                                 or body.get("what") != what):
            why = "stale (written for other versions or steps)"
        if body is None or why:
            log.warning("compile cache entry %s: %s; ignored, rebuilt by this warm-up", path, why)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return body

    def record(self, what: dict[str, Any], seconds: float, graphs: int) -> Path:
        """The entry of a warm-up that compiled and autotuned what `what` names."""
        path = self.entry_path(what)
        _write_json(path, {"what": what, "versions": self.versions, "seconds": seconds,
                           "graphs": graphs, "written": time.time()})
        return path


_current: CompileCache | None = None


def use(device: str) -> CompileCache | None:
    """In a shard or draft process, before anything compiles: open this key's directory under
    `$LAYERSPLIT_COMPILE_CACHE` (set by the launcher) and point Triton and inductor at it
    (a user's own directories win). None where no root is set or it cannot be made."""
    global _current
    root = os.environ.get(ROOT_ENV)
    if not root:
        return None
    try:
        cache = CompileCache.open(Path(root), versions(device))
    except OSError as e:
        log.warning("compile caches stay torch's defaults: cannot use %s (%s)", root, e)
        return None
    for key, value in cache.env().items():
        os.environ.setdefault(key, value)
    _current = cache
    log.debug("compile cache %s", cache.dir)
    return cache


def current() -> CompileCache | None:
    """The process's compile cache (`use`), if any."""
    return _current
