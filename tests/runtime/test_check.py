"""`layersplit check`: our runtime against transformers, position by position, through real shard
processes; and a harness that fails when one layer's weights are off by 1 %."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from layersplit.draft.prompts import CODE_TASKS, CODE_TEMPLATES, TEMPLATES, TOPICS
from layersplit.runtime.check import (
    CheckOptions,
    FreeRun,
    compare_free,
    load_prompts,
    run_check,
)
from layersplit.runtime.check_reference import (
    ReferenceRun,
    ReferenceUnavailable,
    run_reference,
)
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.parity import Agreement, Thresholds, kl_divergence
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_hybrid
from safetensors.torch import load_file, save_file

from tests.helpers import run_cli, write_fp8

FAST = dict(limit=3, new_tokens=12)


def _cfg(model, devices, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model), devices=tuple(devices), max_context=512,
                         prefill_chunk=16, threads=1, **kw)


# ---- measures -------------------------------------------------------------------------------
def test_agreement_measures():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(5, 11)).astype(np.float32)
    a = Agreement()
    a.add(ref, ref.copy())
    assert a.top1 == 1.0 and a.mean_kl < 1e-12 and a.logit_diff_max == 0.0
    ours = ref.copy()
    ours[2] = ref[2] * 0.0  # flat: another argmax, a positive KL
    ours[2, (ref[2].argmax() + 1) % 11] = 5.0
    b = Agreement()
    b.add(ref, ours)
    assert b.top1 == 0.8 and b.kl_max == pytest.approx(kl_divergence(ref[2:3], ours[2:3])[0])
    ours[4, 3] = np.nan
    c = Agreement()
    c.add(ref, ours)
    assert c.nonfinite == 1 and c.top1 == 0.6 and c.to_json()["max_kl"] == "inf"
    assert Thresholds.for_dtype("float32").failures(c, "x")[0] == \
        "x: 1 positions with non-finite logits"
    with pytest.raises(ValueError, match="shape"):
        a.add(ref, ref[:3])


def test_free_running_compares_a_stopped_answer_without_its_stop_token():
    """A request's tokens leave out the stop token that ended it; the reference's keep it (and
    the logits of both have its row)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 7)).astype(np.float32)
    refs = [ReferenceRun([1], [4, 5, 2], logits), ReferenceRun([1], [4, 5, 6], logits)]
    run = FreeRun([[4, 5], [4, 3]], [logits, logits[:2]], [0, 0], ["none"] * 2, 0, [], 0.0)
    out = compare_free(refs, run, (2,))
    assert out["greedy_equal"] == 1  # the first: equal; the second parts at its second token
    assert out["agreement"]["positions"] == 3 + 2


# ---- prompts --------------------------------------------------------------------------------
def test_bundled_prompts_are_unseen_by_the_draft():
    items = load_prompts(None)
    assert len(items) >= 50
    texts = [m["content"] for it in items for m in it["messages"]]
    assert len(set(texts)) == len(texts)
    training = {t.format(t=x) for t in TEMPLATES for x in TOPICS}
    training |= {t.format(t=x) for t in CODE_TEMPLATES for x in CODE_TASKS}
    assert not training & set(texts)


@pytest.mark.parametrize("line,error", [
    ("{not json", "line 2: not JSON"),
    ('{"text": "hi"}', "line 2: expected an object with one of messages, prompt or tokens"),
    ('["a"]', "line 2: expected an object"),
])
def test_bad_prompt_files_are_named(tmp_path, line, error):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=error):
        load_prompts(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def test_missing_reference_is_named_with_its_install(monkeypatch, tiny_llama):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # (import fails)
    with pytest.raises(ReferenceUnavailable, match="pip install llama-cpp-python"):
        run_reference("llama.cpp", tiny_llama, [[1, 2]], 4, (2,), "cpu")
    with pytest.raises(ReferenceUnavailable, match="use one of transformers, llama.cpp"):
        run_reference("vllm", tiny_llama, [[1, 2]], 4, (2,), "cpu")


def test_options_are_checked():
    with pytest.raises(ConfigError, match="restore 'gpu'"):
        CheckOptions(restore=("gpu",))
    with pytest.raises(ConfigError, match="new_tokens=0"):
        CheckOptions(new_tokens=0)


# ---- whole runs through shard processes -------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("check") / "llama", "llama", std=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu", "cpu")])
def test_check_passes_in_float32(model, devices):
    report = run_check(_cfg(model, devices), CheckOptions(**FAST))
    assert report["pass"], report["failures"]
    assert report["positions"] > 3 * 6 and report["top1_agreement"] == 1.0
    assert report["mean_kl"] < 1e-9
    assert report["greedy_equal"] == 3 and report["split"][-1].endswith(":6")


@pytest.mark.slow
def test_check_of_an_fp8_checkpoint(model, tmp_path):
    """transformers reads the FP8 folder dequantized (on any device: `check_reference`), as we
    do: the same logits."""
    dense = tmp_path / "dense"
    shutil.copytree(model, dense)
    report = run_check(_cfg(write_fp8(dense, tmp_path / "fp8"), ("cpu", "cpu")),
                       CheckOptions(**FAST))
    assert report["pass"], report["failures"]
    assert report["top1_agreement"] == 1.0 and report["mean_kl"] < 1e-9


@pytest.mark.slow
def test_check_batched_and_restored_from_ram_and_disk(model, tmp_path):
    opts = CheckOptions(limit=8, new_tokens=8, batch=8, restore=("ram", "disk"))
    mine = tmp_path / "kv"  # the user's cache: the check uses one of its own
    report = run_check(_cfg(model, ("cpu", "cpu"), kv_cache_dir=str(mine)), opts)
    assert report["pass"], report["failures"]
    for tier in ("ram", "disk"):
        run = report["runs"][tier]
        assert run["restored"] == 8 and run["equal_cold"] == 8 and run["cached_tokens"] > 0
        assert run["agreement"]["top1_agreement"] == 1.0
    assert not mine.exists()


@pytest.mark.slow
def test_a_restore_that_does_not_happen_fails_the_check(model):
    """With the RAM tier off, nothing restores: the check says so instead of comparing a cold
    run with another cold run."""
    report = run_check(_cfg(model, ("cpu",), cache_ram_gb=0.0),
                       CheckOptions(limit=2, new_tokens=4, restore=("ram",)))
    assert not report["pass"] and report["runs"]["ram"]["restored"] == 0
    assert any("not restored whole from the ram tier" in f for f in report["failures"])


@pytest.mark.slow
def test_check_with_speculation(target, dflash):
    report = run_check(_cfg(target, ("cpu", "cpu"), draft=str(dflash)),
                       CheckOptions(**FAST, batch=2))
    assert report["pass"], report["failures"]
    assert report["runs"]["speculative"]["equal_plain"] == 3
    assert report["runs"]["speculative"]["speculated"] == 3  # (spec_max_seqs: the batch's)
    off = run_check(_cfg(target, ("cpu",), draft=str(dflash), spec_max_seqs=0),
                    CheckOptions(limit=1, new_tokens=4))
    assert any("no request speculated" in f for f in off["failures"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3_text", "qwen3_5"])
def test_check_other_families(tmp_path, family):
    if family == "qwen3_5":
        path = write_tiny_hybrid(tmp_path / family, family)
    else:
        path = write_tiny_checkpoint(tmp_path / family, family, std=0.2)
    report = run_check(_cfg(path, ("cpu", "cpu")), CheckOptions(limit=2, new_tokens=8))
    assert report["pass"], report["failures"]
    assert report["top1_agreement"] == 1.0


def test_reference_runs_transformers_own_code_not_a_kernel_package(tmp_path, monkeypatch):
    """Where a kernel package (fla, causal-conv1d) stands in for a function of transformers'
    modeling code, the reference runs transformers' own torch code: the runtime runs those same
    kernels, and a reference through them would share their errors."""
    import functools
    import importlib

    import torch
    from layersplit.runtime.check_reference import KERNEL_PACKAGE_FUNCTIONS, load_transformers

    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    for name in KERNEL_PACKAGE_FUNCTIONS:
        def kernel(*args, _name=name, **kwargs):
            raise AssertionError(f"the kernel package's {_name} ran")
        monkeypatch.setattr(module, name, functools.wraps(getattr(module, name))(kernel))
    hf = load_transformers(write_tiny_hybrid(tmp_path / "h", "qwen3_5"), "cpu")
    with torch.no_grad():  # (a prefill, then decode steps: every function of the list runs)
        out = hf.generate(torch.tensor([[5, 9, 14, 20, 33, 41]]), max_new_tokens=3,
                          do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.slow
def test_check_fails_when_one_layer_is_off_by_one_percent(model, tmp_path):
    """The harness can fail: our runtime reads a copy whose layer-3 down projection is scaled
    by 1.01, the reference the original."""
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"] *= 1.01
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    common = ["--devices", "cpu,cpu", "--max-context", "512", "--threads", "1",
              "--limit", "3", "--new-tokens", "12", "--json"]
    # both as commands run in this process (`run_cli`: `layersplit check`, its exit code the
    # one `main` returns; a fresh interpreter would import torch and transformers again)
    good = run_cli("check", "--model", str(model), *common)
    out = run_cli("check", "--model", str(bad), "--reference-model", str(model), *common)
    assert good.returncode == 0, good.stderr[-2000:]
    assert json.loads(good.stdout)["pass"] is True
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["pass"] is False and report["mean_kl"] > 1e-6
    assert any("teacher-forced" in f for f in report["failures"])


def test_check_refuses_a_reference_it_cannot_run(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ReferenceUnavailable, match="llama-cpp-python"):
        run_check(_cfg(model, ("cpu",)), CheckOptions(reference="llama.cpp", limit=1))


@pytest.mark.slow
def test_check_reports_logits_that_went_nonfinite(model, tmp_path):
    """Our copy has a NaN weight: every request fails by name; the check reports it (not a
    crash), and fails."""
    bad = tmp_path / "nan"
    shutil.copytree(model, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.4.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = run_check(_cfg(bad, ("cpu",)), CheckOptions(limit=2, new_tokens=4,
                                                    reference_model=str(model)))
    assert not r["pass"] and r["nonfinite_positions"] == r["positions"] > 0
    assert r["mean_kl"] == "inf" and r["runs"]["plain"]["errors"] == 2
    assert any("NaN or infinity" in f for f in r["failures"])
    assert r["first_nonfinite_layer"] == "layer 4"  # (the walk, layer by layer)


def test_half_agreement_runs_transformers_whole_and_stepwise(model):
    """transformers against its own float32 run, in float32: the one-forward and the stepwise
    (prefill, then a token a step on its KV cache) teacher-forced logits both equal the
    reference's, and its free-running tokens too; a reference whose tokens are not the model's
    shows in both."""
    from layersplit.runtime.check_reference import half_agreement

    prompts = [[5, 9, 17, 33, 2], [40, 41, 7]]
    refs = run_reference("transformers", model, prompts, 8, [], "cpu")
    same = half_agreement(model, refs, "float32", "cpu", 8, [])
    assert same["positions"] == same["stepwise"]["positions"] == 16
    assert same["mean_kl"] < 1e-9 and same["stepwise"]["mean_kl"] < 1e-9
    assert same["greedy_equal"] == 2
    wrong = [ReferenceRun(r.prompt, [(t + 1) % 300 for t in r.tokens], r.logits) for r in refs]
    off = half_agreement(model, wrong, "float32", "cpu", 8, [])
    assert off["stepwise"]["mean_kl"] > 1e-3 and off["greedy_equal"] == 0
    free_only = half_agreement(model, refs, "float32", "cpu", 8, [], stepwise=False)
    assert "stepwise" not in free_only and free_only["greedy_equal"] == 2
