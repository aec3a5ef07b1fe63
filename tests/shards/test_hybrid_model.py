"""Hybrid models (Qwen3.5 text, Qwen3-Next) equal transformers' own, whole and range by range;
each range reads only its tensors; bad configs and files are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor

transformers = pytest.importorskip("transformers")
FAMILIES = ("qwen3_5", "qwen3_next")


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hybrid_models, family):
    """Prefill chunks longer than one delta-rule chunk (64), then decode steps."""
    path = hybrid_models[family]
    ckpt = open_checkpoint(path)
    assert ckpt.config.hybrid is not None
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=256)
    ids = _ids(155)
    ours = [ex.run(ids[a:b], a, all_logits=True) for a, b in ((0, 80), (80, 150))]
    ours += [ex.run(ids[t:t + 1], t) for t in range(150, 155)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = torch.cat(ours)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [(0, 2, 4, 6), (0, 1, 6), (0, 3, 6)])
def test_range_by_range_equals_whole(hybrid_models, family, split):
    ckpt = open_checkpoint(hybrid_models[family])
    whole = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=128)
    parts = [RangeExecutor(load_layer_range(ckpt, a, b), max_len=128)
             for a, b in zip(split[:-1], split[1:])]
    ids = _ids(92, seed=2)
    for a, b in ((0, 70), (70, 90), (90, 91), (91, 92)):  # prefill chunks, then decode
        x = ids[a:b]
        for p in parts:
            x = p.run(x, a, all_logits=True)
        assert torch.equal(x, whole.run(ids[a:b], a, all_logits=True))


def test_a_range_reads_only_its_tensors(hybrid_models):
    ckpt = open_checkpoint(hybrid_models["qwen3_next"])
    mid = load_layer_range(ckpt, 2, 4)  # a linear layer with experts, one dense-MLP layer
    names = {n for n, _ in mid.named_parameters()}
    assert all(n.startswith(("layers.0.", "layers.1.")) for n in names), names
    assert any("mlp.experts.down_proj" in n for n in names)
    assert mid.embed_tokens is None and mid.lm_head is None


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, words", [
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 3}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.factor"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
])
def test_unsupported_hybrid_fields_are_refused(hybrid_models, tmp_path, change, words):
    bad = _edit(hybrid_models["qwen3_5"], tmp_path / "bad", **change)
    with pytest.raises(CheckpointError, match=words):
        open_checkpoint(bad)


def test_vision_language_checkpoint_is_refused(hybrid_models, tmp_path):
    src = json.loads((hybrid_models["qwen3_5"] / "config.json").read_text())
    bad = _edit(hybrid_models["qwen3_5"], tmp_path / "vl", model_type="qwen3_5",
                text_config=src)
    with pytest.raises(CheckpointError, match="vision-language"):
        open_checkpoint(bad)


def test_missing_expert_tensor_is_named(hybrid_models, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "noexpert"
    shutil.copytree(hybrid_models["qwen3_next"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.4.mlp.experts.1.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj"):
        load_layer_range(open_checkpoint(bad), 3, 6)
    load_layer_range(open_checkpoint(bad), 0, 3)  # other ranges never read it


def test_gguf_of_a_hybrid_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "next.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3next")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="qwen3next.*not supported yet"):
        open_checkpoint(path)
