"""DFlash drafts as z-lab publishes them: the published config (every field and key name kept,
only widths and layer counts shrunk to a tiny target) and safetensors key names load and
speculate losslessly against Qwen3 and Qwen3.5 (hybrid) targets (the reference's plain runs,
greedy and sampled, logits included); a draft that does not fit its target, or that needs what
is not implemented, is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layersplit.draft.proposer import DFlashProposer, load_proposer
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig, read_hf_config
from layersplit.shards.random_weights import PRESETS_DIR
from layersplit.shards.sampling import SamplingParams
from safetensors.torch import save_file

from tests.helpers import assert_speculated_equals, run_logged

PUBLISHED = PRESETS_DIR / "qwen3-8b-dflash-b16" / "config.json"  # z-lab/Qwen3-8B-DFlash-b16's
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)


def published_keys(layers: int, bias: bool = False) -> list[str]:
    """The tensor names of z-lab's DFlashDraftModel state dict (no `model.` prefix, no
    embedding and no LM head: those are the target's)."""
    per_layer = [f"self_attn.{p}_proj.bias" for p in "qkvo" if bias] + [
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    return ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{k}" for i in range(layers) for k in per_layer]


def write_published(target: ModelConfig, out: Path, taps: list[int], layers: int = 2,
                    **overrides) -> Path:
    """A random-weight draft of `target` in the published layout: the published config.json with
    the widths, layer counts, taps and mask token of the tiny target, everything else as
    published; tensors under the published names."""
    raw = json.loads(PUBLISHED.read_text())
    heads, kv, d = target.num_heads, target.num_kv_heads, target.head_dim
    raw.update(hidden_size=target.hidden_size, intermediate_size=96, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers,
               max_window_layers=layers, layer_types=["full_attention"] * layers,
               vocab_size=target.vocab_size, num_target_layers=target.num_layers)
    raw["dflash_config"] = {"mask_token_id": target.vocab_size - 1, "target_layer_ids": taps}
    raw.update(overrides)
    h, f = raw["hidden_size"], raw["intermediate_size"]
    shapes = {"fc.weight": (h, len(taps) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    bias = raw.get("attention_bias")
    for i in range(layers):
        if bias:  # (z-lab's layers bias o_proj too)
            shapes.update({f"layers.{i}.self_attn.{p}_proj.bias": (n * d,) for p, n in
                           (("q", heads), ("k", kv), ("v", kv))})
            shapes[f"layers.{i}.self_attn.o_proj.bias"] = (h,)
        shapes.update({
            f"layers.{i}.self_attn.q_proj.weight": (heads * d, h),
            f"layers.{i}.self_attn.k_proj.weight": (kv * d, h),
            f"layers.{i}.self_attn.v_proj.weight": (kv * d, h),
            f"layers.{i}.self_attn.o_proj.weight": (h, heads * d),
            f"layers.{i}.self_attn.q_norm.weight": (d,),
            f"layers.{i}.self_attn.k_norm.weight": (d,),
            f"layers.{i}.mlp.gate_proj.weight": (f, h), f"layers.{i}.mlp.up_proj.weight": (f, h),
            f"layers.{i}.mlp.down_proj.weight": (h, f),
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,)})
    assert sorted(shapes) == sorted(published_keys(layers, bias))
    g = torch.Generator().manual_seed(0)
    tensors = {k: (1 + 0.1 * torch.randn(s, generator=g)) if k.endswith("norm.weight") else
               0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def qwen35(hybrid_models):
    return hybrid_models["qwen3_5"]


def test_published_config_keeps_every_field(qwen3, tmp_path):
    published = json.loads(PUBLISHED.read_text())
    path = write_published(read_hf_config(qwen3), tmp_path / "d", [1, 4])
    assert set(json.loads((path / "config.json").read_text())) == set(published)
    p = load_proposer(path, qwen3, "cpu", torch.float32, 64)
    assert isinstance(p, DFlashProposer) and p.block_size == 16
    assert p.cfg.target_layer_ids == (1, 4) and p.cfg.mask_token_id == 319
    # the shared embedding and LM head are the target's
    assert p.embed.shape == p.head.shape == (320, 64)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_published_draft_speculates_losslessly(family, qwen3, qwen35, tmp_path):
    target = qwen3 if family == "qwen3" else qwen35
    cfg = read_hf_config(target)
    # for Qwen3.5, as z-lab's Qwen3.5-27B draft: a sliding-window layer (its block causal)
    # before a full one, the window (8) shorter than the context
    windows = {} if family == "qwen3" else {
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    draft = write_published(cfg, tmp_path / "draft", [1, 3, 5], **windows)
    prompt = list(range(5, 40))
    ref = ReferenceEngine(target, prefill_chunk=16, max_context=128)
    want = {p.temperature: run_logged(ref, prompt, p) for p in (GREEDY, SAMPLED)}
    assert len(set(want[0.0][0].tokens)) > 3  # (a target that varies its output)
    run = RuntimeConfig(model=str(target), devices=("cpu",), prefill_chunk=16, max_context=128,
                        threads=1, draft=str(draft), spec_block=6)
    with Coordinator(run) as coord:
        assert coord.draft_info["kind"] == "dflash" and coord.draft_info["taps"] == [1, 3, 5]
        for p in (GREEDY, SAMPLED):  # the reference's plain runs, tokens and float32 logits
            assert_speculated_equals(coord, prompt, p, want[p.temperature],
                                     f"temperature {p.temperature}")


@pytest.mark.parametrize("change,match", [
    ({"hidden_size": 32}, "hidden_size"),
    ({"vocab_size": 999}, "vocab_size 999"),
    ({"num_target_layers": 36}, "36 layers"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 9, 17]}}, "layer 9"),
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    ({"selector_rank": 256}, "selector_rank"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None},
     "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"output_multiplier": 2.0}, "output_multiplier"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
])
def test_mismatched_or_unimplemented_is_refused(qwen3, tmp_path, change, match):
    path = write_published(read_hf_config(qwen3), tmp_path / "d", [1, 4], **change)
    with pytest.raises(CheckpointError, match=match):
        load_proposer(path, qwen3, "cpu", torch.float32, 64)


def test_biased_o_proj_is_refused(qwen3, tmp_path):
    path = write_published(read_hf_config(qwen3), tmp_path / "d", [1, 4], attention_bias=True)
    with pytest.raises(CheckpointError, match="o_proj.bias"):
        load_proposer(path, qwen3, "cpu", torch.float32, 64)


def test_draft_of_another_family_is_refused(qwen3, qwen35, tmp_path):
    """A draft written for the Qwen3 target, given the hybrid Qwen3.5 one (another width)."""
    path = write_published(read_hf_config(qwen3), tmp_path / "d", [1, 4])
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_proposer(path, qwen35, "cpu", torch.float32, 64)


@pytest.mark.parametrize("draft,target", [("qwen3-8b-dflash-b16", "qwen3-8b"),
                                          ("qwen3.5-27b-dflash", "qwen3.5-27b")])
def test_presets_fit_their_targets(draft, target):
    """The random-weight drafts of the published shapes (`random:NAME`) fit their targets."""
    from layersplit.draft.dflash_config import dflash_folder, read_dflash_config
    from layersplit.shards.checkpoint import open_checkpoint

    folder = dflash_folder(f"random:{draft}")
    cfg = read_dflash_config(folder)
    cfg.check_target(open_checkpoint(f"random:{target}").config, folder)
    assert cfg.block_size == 16 and cfg.model.num_layers == 5


def test_random_weights_of_a_published_layout(qwen3, tmp_path):
    """`random:FOLDER`: the draft of that config with seeded random weights (its safetensors
    are not read), the same twice."""
    path = write_published(read_hf_config(qwen3), tmp_path / "d", [1, 4])
    (path / "model.safetensors").unlink()
    a, b = (load_proposer(f"random:{path}", qwen3, "cpu", torch.float32, 64) for _ in range(2))
    assert isinstance(a, DFlashProposer) and a.cfg.target_layer_ids == (1, 4)
    assert torch.equal(a.draft.fc.weight, b.draft.fc.weight) and a.draft.fc.weight.std() > 0.01
