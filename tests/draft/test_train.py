"""`python -m draft.train` end to end on a tiny target (CPU, seconds): it trains (the loss falls,
the weights move), and writes a DFlash draft in the published layout and a classic draft, both of
which the runtime's draft loader accepts for this target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draft.proposer import ClassicProposer, DFlashProposer, load_proposer
from draft.train import main as train
from shards.tiny import write_tiny_checkpoint


@pytest.mark.slow
def test_training_writes_loadable_drafts(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "t", "llama", std=0.2)
    out, classic, report = tmp_path / "dflash", tmp_path / "classic", tmp_path / "r.json"
    rc = train(["--target", str(target), "--out", str(out), "--device", "cpu",
                "--seconds", "4", "--prompts", "12", "--new-tokens", "24", "--code-files", "2",
                "--batch", "4", "--anchors", "4", "--layers", "1", "--block", "4",
                "--taps", "1,4", "--gen-batch", "12", "--classic-out", str(classic),
                "--classic-seconds", "2", "--classic-layers", "2", "--report", str(report)])
    assert rc == 0
    r = json.loads(report.read_text())
    assert r["taps"] == [1, 4] and r["steps"] > 500 and len(r["history"]) >= 2
    assert r["history"][-1]["loss"] < r["history"][0]["loss"]  # the KL fell
    p = load_proposer(out, target, "cpu", torch.float32, 64)
    assert isinstance(p, DFlashProposer) and p.cfg.target_layer_ids == (1, 4)
    c = load_proposer(classic, target, "cpu", torch.float32, 64)
    assert isinstance(c, ClassicProposer) and c.ex.model.num_layers == 2
    # the classic draft started as the target's first layers: distillation moved them
    before = load_file(str(target / "model.safetensors"))
    after = load_file(str(classic / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(before[name], after[name].float(), atol=1e-3)
