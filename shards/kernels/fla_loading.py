"""Importing fla-core's kernels the fast way: on a GPU whose tuned launch configs we ship, with
those configs instead of an autotune of every candidate; and only the modules we call
(`LAYERSPLIT_FLA_BARE_IMPORT=0`: its whole package).

A cold start of the Qwen3.5-27B shape on an H200 (empty compile caches, 2026-12-01, py-spy over
`bench/startup.py`) spent 7.4 s importing fla-core (its package `__init__`s import every op
family it has, and its models) and ~37 s in the first prefill, compiling and timing each
candidate launch config of its chunked delta rule's and causal conv's Triton kernels: most of the
first request's time. vLLM ships its fused-MoE kernel's tuned configs per GPU model for the same
reason; fla-core reads such files itself (`fla.ops.utils.cache`: `FLA_CONFIG_DIR`,
`FLA_CACHE_MODE`), which `bench/fla_configs.py` writes from a device's own autotune into
`fla_configs/<GPU name>/`. A kernel whose key (its head counts and widths, block sizes, dtypes)
has no entry there autotunes as before, once per machine (Triton's own cache under
$LAYERSPLIT_HOME keeps the result). A user's own `FLA_CONFIG_DIR` or `FLA_CACHE_MODE` wins.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import pkgutil
import re
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layersplit.shards.kernels import switched_off

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parent / "fla_configs"
# fla's packages whose `__init__` imports far more than the modules below it that we call
HEAVY_PACKAGES = ("fla", "fla.ops", "fla.modules")
# fla's modules imported bare (`import_fla`), on by default (0: fla-core's whole import): on an
# H200 the delta rule's, the conv's and the config cache's modules import bare in 1.32 s (1.69 /
# 1.22 / 1.32) against 3.24 s whole (2.78 / 3.34 / 3.24), processes in turn (2026-12-01,
# `STARTUP=fla_import bash bench/device.sh startup`); on the CPU development VM 1.84 s (60
# modules) against 8.61 s (274). Its GPU tests (`tests/gpu/test_hybrid_gemv.py`,
# `test_gated_delta_rows.py`, `test_fla_configs.py`) passed with it on
BARE_SWITCH = "LAYERSPLIT_FLA_BARE_IMPORT"


def fla_version() -> str | None:
    """The installed fla-core's version, or None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return None


def gpu_dir_name(gpu_name: str) -> str:
    """A GPU's model name as fla-core names its config folders (`sanitize_gpu_name`)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu"


def shipped_configs(gpu_name: str, root: Path | None = None) -> Path | None:
    """The folder of tuned configs shipped for this GPU model (under `root`, default CONFIGS),
    or None."""
    folder = (CONFIGS if root is None else root) / gpu_dir_name(gpu_name)
    return folder if any(folder.glob("*.json")) else None


def configs_in_force(gpu_name: str) -> Path | None:
    """The folder of configs shipped for `gpu_name` that `tuned_configs` has fla-core read, or
    None: none shipped, or the user's own FLA_CACHE_MODE or FLA_CONFIG_DIR set."""
    folder = shipped_configs(gpu_name)
    if folder is None or "FLA_CACHE_MODE" in os.environ:
        return None
    given = os.environ.get("FLA_CONFIG_DIR")
    return folder if given is None or given == str(folder) else None


# import_fla's and tuned_configs' changes to sys.modules and the environment are made under
# this lock (shards load their kernels on one thread; a second one must not interleave)
_LOCK = threading.RLock()
_stubs: dict[str, types.ModuleType] = {}  # the bare packages `import_fla` put in sys.modules


def _bare_package(name: str) -> None:
    """Put package `name` in sys.modules without running its `__init__` (its submodules import
    as usual): a module object with the package's spec, search path (namespace parts included,
    as `pkgutil.extend_path` in fla's `__init__` finds them) and declared version."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"No module named {name!r}", name=name)
    module = types.ModuleType(name)
    module.__spec__, module.__file__ = spec, spec.origin
    module.__path__ = pkgutil.extend_path(list(spec.submodule_search_locations), name)
    module.__package__ = name
    version = _declared_version(spec.origin)
    if version is not None:  # (fla's modules read `from fla import __version__`)
        module.__version__ = version
    sys.modules[name] = module
    _stubs[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _drop(top: str) -> None:
    """Take `top`'s bare packages out of sys.modules: the next import of them runs their real
    `__init__`s (submodules still loaded are reused)."""
    for name in [n for n in _stubs if n == top or n.startswith(top + ".")]:
        if sys.modules.get(name) is _stubs.pop(name):
            del sys.modules[name]


def _declared_version(init: str | None) -> str | None:
    """The `__version__ = "..."` a package's `__init__.py` declares, read without running it."""
    try:
        text = Path(init).read_text() if init else ""
    except OSError:
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def import_fla(*names: str, heavy: tuple[str, ...] = HEAVY_PACKAGES,
               bare: bool | None = None) -> list[types.ModuleType]:
    """fla-core's modules `names`; with `bare` (default: BARE_SWITCH not off), imported without the
    `__init__`s of the `heavy` packages where none of them is imported yet (where one is, or
    where a module needs a name only they define, as usual). The bare packages leave
    sys.modules once `names` are loaded, so that any later `import fla` is the whole one."""
    if bare is None:
        bare = not switched_off(BARE_SWITCH)
    with _LOCK:
        if bare and not any(p in sys.modules for p in heavy):
            before = set(sys.modules)
            try:
                for package in heavy:
                    _bare_package(package)
                return [importlib.import_module(n) for n in names]
            except Exception as e:  # noqa: BLE001 - (a module that reads a name those
                # `__init__`s define, an ImportError or another: the usual import, what this
                # call loaded under the bare packages dropped; what earlier calls loaded stays,
                # as configured)
                log.info("%s under bare packages failed (%s); importing them whole", names, e)
                for name in set(sys.modules) - before:
                    if name == heavy[0] or name.startswith(heavy[0] + "."):
                        del sys.modules[name]
            finally:
                _drop(heavy[0])
        return [importlib.import_module(n) for n in names]


@contextlib.contextmanager
def tuned_configs(gpu_name: str) -> Iterator[Path | None]:
    """Around the import of fla's kernel modules: where configs are shipped for `gpu_name` and
    the user set neither FLA_CONFIG_DIR nor FLA_CACHE_MODE, fla-core reads them for its kernels
    declared with its own autotune (`fla_cache_autotune`: all of the delta rule's and the
    conv's whose configs are shipped), in strict mode (a config only for the exact key it was
    tuned for). Yields the folder or None (where the kernels autotune)."""
    with _LOCK:
        folder = configs_in_force(gpu_name)
        if folder is None:
            yield None
            return
        os.environ["FLA_CONFIG_DIR"] = str(folder)  # (fla reads it at each lookup)
        try:
            (cache,) = import_fla("fla.ops.utils.cache")
            # (the mode fla read from the environment when this module was first imported,
            # whenever that was: set where fla reads it at each call)
            cache.FLA_CACHE_MODE = cache.FlaCacheMode.STRICT
        except Exception as e:  # noqa: BLE001 - no fla-core, or one without config files
            del os.environ["FLA_CONFIG_DIR"]
            if not (isinstance(e, ImportError) and (e.name or "").split(".")[0] == "fla"):
                log.warning("fla-core's kernels autotune: its config files could not be set "
                            "up (%s: %s)", type(e).__name__, e)
            yield None
            return
        yield folder
        now = sys.modules.get("fla.ops.utils.cache")  # (a whole import of fla in the body
        if now is not None and now is not cache:  # loaded the module again, from the
            now.FLA_CACHE_MODE = now.FlaCacheMode.STRICT  # environment's mode)


def _autotuners() -> Iterator[Any]:
    """Every Triton autotuner in fla's loaded modules (under a heuristics wrapper or not): fla's
    own (`CachedAutotuner`, which reads config files) and Triton's."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            while isinstance(value, Heuristics):
                value = value.fn
            if isinstance(value, Autotuner) and id(value) not in seen:
                seen.add(id(value))
                yield value


def kernel_name(tuner: Any) -> str:
    """An autotuner's kernel: its Python function's name (fla's `kernel_name`), under any
    wrappers."""
    from triton.runtime.jit import JITFunction

    fn = tuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn.fn.__name__


def config_files() -> dict[str, dict[str, Any]]:
    """fla-core's config files ({kernel name}.json, its `KernelConfigFile` layout) for every
    config its autotuners chose in this process: what `bench/fla_configs.py` ships."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    files: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    shared: set[str] = set()  # (names of two kernels that both chose configs here: fla would
    # give either one's configs to both, so neither is written)
    for tuner in _autotuners():
        if not tuner.cache or not isinstance(tuner, CachedAutotuner):  # (Triton's own
            continue  # autotune reads no config file)
        name = kernel_name(tuner)
        if owner.setdefault(name, id(tuner)) != id(tuner):
            shared.add(name)
        for key, cfg in tuner.cache.items():
            entries = files.setdefault(name, {"kernel_name": name,
                                              "triton_version": triton.__version__,
                                              "autotune_entries": {}})["autotune_entries"]
            entries[AutotuneKey.key_hash(list(key))] = {
                "autotune_key": list(key),
                "config": {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps,
                           "num_stages": cfg.num_stages, "num_ctas": cfg.num_ctas,
                           "maxnreg": cfg.maxnreg}}
    for name in shared:
        log.warning("fla-core has two kernels named %s: their configs are not written", name)
        files.pop(name, None)
    return files


def write_config_files(files: dict[str, dict[str, Any]], folder: Path) -> int:
    """Merge `files` into `folder` (entries already there for other keys stay); returns the
    number of entries written."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, data in files.items():
        path = folder / f"{name}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        entries = {**old.get("autotune_entries", {}), **data["autotune_entries"]}
        path.write_text(json.dumps({**data, "autotune_entries": entries}, indent=1,
                                   sort_keys=True) + "\n")
        n += len(data["autotune_entries"])
    return n
