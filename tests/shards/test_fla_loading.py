"""`shards.kernels.fla_loading`: fla-core's modules imported without its heavy package
`__init__`s, and the tuned configs shipped per GPU model (fla's kernels themselves: the GPU
test `tests/gpu/test_fla_configs.py`)."""

import json
import os
import sys
import types

import pytest
from layersplit.shards.kernels import fla_loading


@pytest.fixture()
def fake_fla(tmp_path, monkeypatch):
    """A package `fakefla` shaped as fla-core: `__init__`s that record that they ran, a kernel
    module under `fakefla.ops`, and one that reads a name only `fakefla/__init__.py` defines."""
    root = tmp_path / "fakefla"
    (root / "ops" / "rule").mkdir(parents=True)
    (root / "__init__.py").write_text("import os\nos.environ['FAKEFLA_RAN'] = '1'\nNAME = 7\n"
                                      "__version__ = '1.2.3'\n")
    (root / "ops" / "__init__.py").write_text("raise RuntimeError('fakefla.ops ran')\n")
    (root / "ops" / "rule" / "__init__.py").write_text("from .kernel import rule\n")
    (root / "ops" / "rule" / "kernel.py").write_text("def rule():\n    return 42\n")
    (root / "needs_init.py").write_text("from fakefla import NAME\n")
    (root / "needs_version.py").write_text("from fakefla import __version__\n")
    (root / "reads_attr.py").write_text("import fakefla\nN = fakefla.NAME + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FAKEFLA_RAN", raising=False)
    yield ("fakefla", "fakefla.ops")
    for name in [m for m in sys.modules if m == "fakefla" or m.startswith("fakefla.")]:
        del sys.modules[name]


def test_a_module_imports_without_its_packages_init(fake_fla):
    (mod,) = fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla, bare=True)
    assert mod.rule() == 42
    assert "FAKEFLA_RAN" not in os.environ  # (and fakefla.ops's would have raised)
    assert "fakefla" not in sys.modules and not fla_loading._stubs  # (the bare ones dropped)


def test_a_later_import_of_the_package_is_the_whole_one(fake_fla):
    fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla, bare=True)
    import fakefla

    assert fakefla.NAME == 7 and os.environ["FAKEFLA_RAN"] == "1"
    assert sys.modules["fakefla.ops.rule"].rule() == 42  # (the module loaded bare, reused)


def test_the_bare_package_carries_its_declared_version(fake_fla):
    (mod,) = fla_loading.import_fla("fakefla.needs_version", heavy=fake_fla, bare=True)
    assert mod.__version__ == "1.2.3"
    assert "FAKEFLA_RAN" not in os.environ


def test_a_module_that_reads_the_packages_names_imports_it_whole(fake_fla):
    (mod,) = fla_loading.import_fla("fakefla.needs_init", heavy=fake_fla, bare=True)
    assert mod.NAME == 7 and os.environ["FAKEFLA_RAN"] == "1"


def test_a_module_failing_otherwise_under_the_bare_package_imports_it_whole(fake_fla):
    """(an AttributeError, not an ImportError: a name only the package's `__init__` defines,
    read as an attribute)"""
    (mod,) = fla_loading.import_fla("fakefla.reads_attr", heavy=fake_fla, bare=True)
    assert mod.N == 8 and os.environ["FAKEFLA_RAN"] == "1"


def test_configs_in_force_only_where_shipped_and_not_overridden(tmp_path, monkeypatch):
    (tmp_path / "NVIDIA_H200").mkdir()
    (tmp_path / "NVIDIA_H200" / "k.json").write_text("{}")
    monkeypatch.setattr(fla_loading, "CONFIGS", tmp_path)
    for key in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):
        monkeypatch.delenv(key, raising=False)
    assert fla_loading.configs_in_force("NVIDIA H200") == tmp_path / "NVIDIA_H200"
    assert fla_loading.configs_in_force("NVIDIA H100") is None
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "NVIDIA_H200"))  # (ours, set before)
    assert fla_loading.configs_in_force("NVIDIA H200") == tmp_path / "NVIDIA_H200"
    monkeypatch.setenv("FLA_CONFIG_DIR", "/users/own")
    assert fla_loading.configs_in_force("NVIDIA H200") is None
    monkeypatch.delenv("FLA_CONFIG_DIR")
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert fla_loading.configs_in_force("NVIDIA H200") is None


def test_a_later_bare_import_that_needs_the_whole_package_falls_back_too(fake_fla):
    fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla, bare=True)
    (mod,) = fla_loading.import_fla("fakefla.needs_init", heavy=fake_fla, bare=True)
    assert mod.NAME == 7 and os.environ["FAKEFLA_RAN"] == "1"


def test_a_fallback_keeps_what_earlier_bare_imports_loaded(fake_fla):
    """(fla's config cache module, loaded bare first, keeps the mode set on it.)"""
    (rule,) = fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla, bare=True)
    fla_loading.import_fla("fakefla.needs_init", heavy=fake_fla, bare=True)
    assert sys.modules["fakefla.ops.rule"] is rule


def test_a_missing_heavy_package_leaves_no_bare_package_behind(fake_fla):
    (mod,) = fla_loading.import_fla("fakefla.needs_init", heavy=("fakefla", "fakefla.nosuch"),
                                    bare=True)
    assert mod.NAME == 7 and sys.modules["fakefla"].NAME == 7  # (the real one)
    assert not fla_loading._stubs


def test_once_the_package_is_whole_later_imports_are_as_usual(fake_fla):
    fla_loading.import_fla("fakefla.needs_init", heavy=fake_fla, bare=True)
    with pytest.raises(RuntimeError, match="fakefla.ops ran"):  # (its real __init__ now)
        fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla, bare=True)


@pytest.mark.parametrize("value", [None, "1", "0"])
def test_bare_imports_are_on_unless_switched_off(fake_fla, monkeypatch, value):
    """`LAYERSPLIT_FLA_BARE_IMPORT` (`kernels.switched_off`: on unless set off)."""
    if value is None:
        monkeypatch.delenv(fla_loading.BARE_SWITCH, raising=False)
    else:
        monkeypatch.setenv(fla_loading.BARE_SWITCH, value)
    if value == "0":
        with pytest.raises(RuntimeError, match="fakefla.ops ran"):
            fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla)
    else:
        (rule,) = fla_loading.import_fla("fakefla.ops.rule", heavy=fake_fla)
        assert rule.__name__ == "fakefla.ops.rule"


def test_a_missing_package_is_an_import_error(monkeypatch):
    with pytest.raises(ImportError, match="nosuchfla"):
        fla_loading.import_fla("nosuchfla.ops.x", heavy=("nosuchfla", "nosuchfla.ops"),
                               bare=True)


@pytest.mark.parametrize("name,folder", [("NVIDIA H200", "NVIDIA_H200"),
                                         ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"),
                                         ("AMD Instinct MI300X", "AMD_Instinct_MI300X"),
                                         ("", "unknown_gpu")])
def test_gpu_folders_are_named_as_fla_names_them(name, folder):
    assert fla_loading.gpu_dir_name(name) == folder


def _entry(key, block):
    return {"autotune_key": key, "config": {"kwargs": {"BV": block}, "num_warps": 4,
                                            "num_stages": 2, "num_ctas": 1, "maxnreg": None}}


def test_config_files_merge_with_the_entries_already_there(tmp_path):
    folder = tmp_path / "NVIDIA_H200"
    first = {"k": {"kernel_name": "k", "triton_version": "3.6.0",
                   "autotune_entries": {"a": _entry([16, 48, "torch.bfloat16"], 32)}}}
    second = {"k": {"kernel_name": "k", "triton_version": "3.6.0",
                    "autotune_entries": {"b": _entry([16, 32, "torch.bfloat16"], 64)}}}
    assert fla_loading.write_config_files(first, folder) == 1
    assert fla_loading.write_config_files(second, folder) == 1
    data = json.loads((folder / "k.json").read_text())
    assert set(data["autotune_entries"]) == {"a", "b"}
    assert data["autotune_entries"]["a"]["config"]["kwargs"] == {"BV": 32}
    assert fla_loading.shipped_configs("NVIDIA H200", tmp_path) == folder
    assert fla_loading.shipped_configs("NVIDIA H100", tmp_path) is None


def test_no_shipped_configs_change_nothing(monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    with fla_loading.tuned_configs("A GPU nobody tuned for") as folder:
        assert folder is None
        assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ


@pytest.fixture()
def shipped(tmp_path, monkeypatch):
    """A folder of configs for "NVIDIA H200" under a CONFIGS of the test's own, the user's
    FLA_* unset."""
    folder = tmp_path / "NVIDIA_H200"
    fla_loading.write_config_files({"k": {"kernel_name": "k", "autotune_entries": {
        "a": _entry([1], 16)}}}, folder)
    monkeypatch.setattr(fla_loading, "CONFIGS", tmp_path)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    return folder


@pytest.mark.parametrize("var", ["FLA_CONFIG_DIR", "FLA_CACHE_MODE"])
def test_the_users_own_fla_settings_win(shipped, monkeypatch, var):
    monkeypatch.setenv(var, "theirs")
    with fla_loading.tuned_configs("NVIDIA H200") as used:
        assert used is None
    assert os.environ[var] == "theirs"


def test_the_users_cache_mode_wins_beside_the_folder_we_set(shipped, monkeypatch):
    """(FLA_CONFIG_DIR stays set after a first use: a process started from this one, or a
    later call, with FLA_CACHE_MODE set by the user still reads no configs.)"""
    monkeypatch.setenv("FLA_CONFIG_DIR", str(shipped))
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    with fla_loading.tuned_configs("NVIDIA H200") as used:
        assert used is None


def test_fla_reads_the_shipped_configs_strictly_whenever_it_was_imported(shipped, monkeypatch):
    """fla-core's cache module (here a stand-in: fla is not installed on CPU machines) read
    FLA_CACHE_MODE when it was imported, maybe before: the mode is set on the module."""
    import enum

    cache = types.ModuleType("fla.ops.utils.cache")
    cache.FlaCacheMode = enum.Enum("FlaCacheMode", {"DISABLED": "disabled", "STRICT": "strict"})
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.DISABLED
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", cache)
    with fla_loading.tuned_configs("NVIDIA H200") as used:
        assert used == shipped and os.environ["FLA_CONFIG_DIR"] == str(shipped)
        assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.STRICT
    assert "FLA_CACHE_MODE" not in os.environ  # (not exported to child processes)


def test_a_cache_module_imported_again_inside_reads_the_configs_too(shipped, monkeypatch):
    """(A whole import of fla inside the `with`, after a bare one fell back, may load fla's
    cache module again, reading the environment's mode.)"""
    import enum

    def fake():
        m = types.ModuleType("fla.ops.utils.cache")
        m.FlaCacheMode = enum.Enum("FlaCacheMode", {"DISABLED": "d", "STRICT": "s"})
        m.FLA_CACHE_MODE = m.FlaCacheMode.DISABLED
        return m

    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", fake())
    with fla_loading.tuned_configs("NVIDIA H200"):
        again = sys.modules["fla.ops.utils.cache"] = fake()
    assert again.FLA_CACHE_MODE is again.FlaCacheMode.STRICT


def test_without_fla_nothing_is_left_set_and_nothing_is_said(shipped, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", None)  # (its import fails)
    with fla_loading.tuned_configs("NVIDIA H200") as used:
        assert used is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_shipped_folder_holds_fla_config_files():
    """Every file shipped is fla-core's layout: a kernel name and entries each with its key
    and a whole config (what `CachedAutotuner.maybe_load_cached_config` reads)."""
    files = sorted(fla_loading.CONFIGS.glob("*/*.json"))
    assert files  # (H200's, bench/fla_configs.py 2026-12-01)
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem, path
        assert data["autotune_entries"], path
        for entry in data["autotune_entries"].values():
            assert isinstance(entry["autotune_key"], list), path
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= set(entry["config"]), path

