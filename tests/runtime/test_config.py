"""Config files and flags: every shipped config is valid; bad keys and values are named."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from layersplit.runtime.config import (
    ConfigError,
    RuntimeConfig,
    add_flags,
    explicit_keys,
    from_args,
    from_mapping,
    load_toml,
)
from layersplit.runtime.placement import even_split, plan, weighted_split

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    cfg = from_mapping(load_toml(path), str(path))
    p = plan(cfg, 30)  # the default model's layer count
    assert p.shards[0].start == 0 and p.shards[-1].end == 30


def test_unknown_key_and_bad_type(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('modle = "x"\n')
    with pytest.raises(ConfigError, match=r"c\.toml: unknown key modle"):
        from_mapping(load_toml(f), str(f))
    f.write_text("max_context = 'lots'\n")
    with pytest.raises(ConfigError, match="max_context='lots'"):
        from_mapping(load_toml(f), str(f))
    f.write_text("max_context = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(f)
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="local_addresses"):
        from_mapping({"local_addresses": "carrier"}, "x")


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[placement]\ndevices = ["cpu", "cpu", "cpu"]\nsplit = [2, 2, 2]\n')
    p = argparse.ArgumentParser()
    add_flags(p)
    cfg = from_args(p.parse_args(["--config", str(f), "--split", "1,2,3", "--max-context", "99"]))
    assert cfg.devices == ("cpu", "cpu", "cpu") and cfg.split == (1, 2, 3)
    assert cfg.max_context == 99


def test_splits():
    assert even_split(30, 4) == [8, 8, 7, 7]
    assert weighted_split(30, (1.0, 2.0)) == [10, 20]
    assert weighted_split(5, (100.0, 1.0, 1.0)) == [3, 1, 1]
    assert sum(weighted_split(36, (0.3, 0.3, 0.4))) == 36


def test_prefill_chunk_defaults_by_device():
    assert RuntimeConfig().prefill_chunk == 256
    assert RuntimeConfig(devices=("cpu", "cuda:1")).prefill_chunk == 2048
    assert RuntimeConfig(devices=("cuda:0",), prefill_chunk=512).prefill_chunk == 512
    with pytest.raises(ConfigError, match=r"prefill_chunk=-1: must be at least 1 \(0: auto\)"):
        RuntimeConfig(prefill_chunk=-1)


def test_prefill_chunk_auto_survives_files_flags_and_replace(tmp_path):
    """A config file or flag that puts the shards on GPUs gets the GPU chunk (the file's and the
    flags' configs are built from the CPU default's, whose auto chunk was 256), and a replaced
    config decides again for its devices; a chunk given stays as given."""
    assert from_mapping({"devices": ["cuda:0", "cuda:1"]}, "x").prefill_chunk == 2048
    f = tmp_path / "c.toml"
    f.write_text('[placement]\ndevices = ["cuda:0"]\n')
    p = argparse.ArgumentParser()
    add_flags(p)
    assert from_args(p.parse_args(["--config", str(f)])).prefill_chunk == 2048
    assert from_args(p.parse_args(["--devices", "cuda:0,cuda:1"])).prefill_chunk == 2048
    flags = from_args(p.parse_args(["--config", str(f), "--max-context", "99"]))
    assert flags.prefill_chunk == 2048
    assert flags.replace(devices=("cpu",)).prefill_chunk == 256
    assert flags.replace(devices=("cpu",)).replace(devices=("cuda:0",)).prefill_chunk == 2048
    given = from_mapping({"devices": ["cuda:0"], "prefill_chunk": 512}, "x")
    assert given.replace(devices=("cpu",)).prefill_chunk == 512
    assert from_mapping({"devices": ["cuda:0"]}, "x", base=given).prefill_chunk == 512


def test_every_key_is_documented():
    from layersplit.runtime.config import FIELDS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in FIELDS:
        assert f"`{name}`" in doc, name


@pytest.mark.parametrize("values,match", [
    ({"spec_block": 1}, "spec_block=1: must be at least 2"),
    ({"spec_block": "many"}, "spec_block='many' is not a valid int"),
    ({"spec_tree": -1}, "spec_tree=-1: must be at least 0"),
    ({"draft": ""}, "draft is empty"),
    ({"spec_required": "perhaps"}, "spec_required='perhaps' is not a valid bool"),
    ({"spec_push": "sometimes"}, "spec_push='sometimes' is not a valid bool"),
    ({"spec_max_seqs": -1}, "spec_max_seqs=-1: must be at least 0"),
    ({"max_seqs": 0}, "max_seqs=0: use 1..512"),
    ({"chat_template": "/no/such/template.jinja"},
     "chat_template=/no/such/template.jinja: no such file"),
    ({"max_logprobs": -1}, "max_logprobs=-1: must be at least 0"),
    ({"max_seqs": 513}, "max_seqs=513: use 1..512"),
    ({"micro_batches": 5}, r"micro_batches=5: use 0 \(auto\) to 4"),
    ({"spec_sampling": "sometimes"}, "spec_sampling='sometimes': must be one of auto, off"),
    ({"keep_answers_delay_ms": -1}, "keep_answers_delay_ms=-1.0: must be from 0"),
    ({"keep_answers_delay_ms": float("inf")}, "keep_answers_delay_ms=inf: must be from 0"),
    ({"keep_answers_delay_ms": float("nan")}, "keep_answers_delay_ms=nan: must be from 0"),
])
def test_bad_speculation_keys_are_named(values, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping(values, "test")


def test_spec_sampling_auto_is_off_on_gpus_and_coupled_elsewhere():
    """`spec_sampling = auto` (the default): sampled requests decode plainly with a DFlash
    draft where a GPU runs the target or the draft (measured slower than plain there), coupled
    elsewhere; a named mode stays."""
    from layersplit.runtime.speculative import spec_sampling_mode

    assert from_mapping({}, "test").spec_sampling == "auto"
    assert from_mapping({"spec_sampling": "off"}, "test").spec_sampling == "off"
    assert spec_sampling_mode("auto", ["cuda:0", "cuda:0"], "dflash") == "off"
    assert spec_sampling_mode("auto", ["cpu", "cuda:1"], "dflash") == "off"  # a GPU draft
    assert spec_sampling_mode("auto", ["cpu", "cpu"], "dflash") == "coupled"
    assert spec_sampling_mode("auto", ["cuda:0"], "classic") == "coupled"  # (not measured)
    for mode in ("off", "coupled", "rejection", "guesses"):
        assert spec_sampling_mode(mode, ["cuda:1"], "dflash") == mode == \
            spec_sampling_mode(mode, ["cpu"], "classic")


def test_spec_policy_auto_measures_where_a_gpu_runs_the_target_or_the_draft():
    """`spec_policy = auto` (the default) is the measured policy wherever a GPU runs a shard or
    the draft (tests/runtime/test_spec_policy.py: what it decides; tests/draft/
    test_speculative.py: its output is the reference's), every step speculating on CPUs."""
    from types import SimpleNamespace as NS

    from layersplit.runtime.draft_link import DraftLink

    def measures(setting: str, shards: list[str], draft: str) -> bool:
        link = NS(config=NS(spec_policy=setting), draft_device=draft,
                  placement=NS(shards=[NS(device=d) for d in shards]))
        return DraftLink.policy_measures.fget(link)

    assert from_mapping({}, "test").spec_policy == "auto"
    assert measures("auto", ["cuda:0"], "cuda:0") and measures("auto", ["cpu"], "cuda:0")
    assert measures("auto", ["cpu", "cuda:1"], "cpu")
    assert not measures("auto", ["cpu", "cpu"], "cpu")
    assert measures("measured", ["cpu"], "cpu") and not measures("on", ["cuda:0"], "cuda:0")


def test_draft_names_resolve_or_say_what_to_pass(tmp_path):
    from layersplit.runtime.model_store import BUNDLED_DRAFT, resolve_draft

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_draft("none", gguf, "cuda:0") is None
    assert resolve_draft("auto", gguf, "cpu") is None  # row-by-row verify would not pay
    assert resolve_draft("auto", gguf, "cuda:0") == BUNDLED_DRAFT
    assert resolve_draft("auto", tmp_path / "other-model", "cuda:0") is None
    with pytest.raises(FileNotFoundError, match="trained for SmolLM2"):
        resolve_draft("default", tmp_path / "other-model", "cpu")
    with pytest.raises(FileNotFoundError, match="draft '/nowhere' does not exist"):
        resolve_draft("/nowhere", gguf, "cpu")


def test_explicit_keys_come_from_flags_and_the_file(tmp_path):
    """`generate` runs one KV slot unless max_seqs is set by a flag or the config file."""
    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert explicit_keys(parser.parse_args([])) == set()
    assert explicit_keys(parser.parse_args(["--max-seqs", "4"])) == {"max_seqs"}
    f = tmp_path / "c.toml"
    f.write_text("[batch]\nmax_seqs = 2\n[placement]\ndevices = ['cpu']\n")
    assert explicit_keys(parser.parse_args(["--config", str(f)])) == {"max_seqs", "devices"}
