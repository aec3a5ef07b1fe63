"""`python -m layersplit.launch.draft_train` end to end on a tiny target (CPU, seconds): it
trains (the loss falls, the weights move), and writes a DFlash draft in the published layout and a
classic draft, both of which the runtime's draft loader accepts for this target. The sequences it
generates can be saved and trained on again; a file that is not such a sequence file is refused
by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from layersplit.draft.proposer import ClassicProposer, DFlashProposer, load_proposer
from layersplit.launch.draft_train import load_sequences, save_sequences
from layersplit.launch.draft_train import main as train
from layersplit.shards.tiny import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

SMALL = ["--device", "cpu", "--prompts", "12", "--self-prompts", "6", "--val", "2",
         "--new-tokens", "24", "--code-files", "2", "--batch", "4", "--anchors", "4",
         "--layers", "1", "--block", "4", "--taps", "1,4", "--gen-batch", "12",
         "--eval-every", "1"]


@pytest.mark.slow
def test_training_writes_loadable_drafts(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "t", "llama", std=0.2)
    out, classic, report = tmp_path / "dflash", tmp_path / "classic", tmp_path / "r.json"
    data = tmp_path / "seqs.safetensors"
    # a step budget, not a time budget, sets how much it trains: the same on a loaded machine
    rc = train(["--target", str(target), "--out", str(out), *SMALL, "--seconds", "120",
                "--max-steps", "300",
                "--save-data", str(data), "--classic-out", str(classic),
                "--classic-seconds", "120", "--classic-max-steps", "10", "--classic-layers", "2",
                "--report", str(report)])
    assert rc == 0
    r = json.loads(report.read_text())
    assert r["taps"] == [1, 4] and r["steps"] == 300 and len(r["history"]) >= 2
    assert r["history"][-1]["loss"] < r["history"][0]["loss"]  # the KL fell
    p = load_proposer(out, target, "cpu", torch.float32, 64)
    assert isinstance(p, DFlashProposer) and p.cfg.target_layer_ids == (1, 4)
    # its token tree, as chosen on the held-out answers, is the one its config carries (none
    # when no candidate of this tiny draft was ever right)
    assert len(p.cfg.spec_tree or ()) == r["tree_nodes"] <= 31
    c = load_proposer(classic, target, "cpu", torch.float32, 64)
    assert isinstance(c, ClassicProposer) and c.ex.model.num_layers == 2
    # the classic draft started as the target's first layers: distillation moved them
    before = load_file(str(target / "model.safetensors"))
    after = load_file(str(classic / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(before[name], after[name].float(), atol=1e-3)

    # the saved sequences: 12 template prompts (and the user turns the target wrote) answered
    # greedily, a quarter of them again sampled, source files continued; training on them
    # again sees the same sequences
    sets = load_sequences(data)
    seqs, starts = sets["train"]
    assert len(seqs) >= 12 + 3 and all(0 < s < len(q) for q, s in zip(seqs, starts))
    again = tmp_path / "r2.json"
    rc = train(["--target", str(target), "--out", str(tmp_path / "again"), *SMALL,
                "--seconds", "60", "--max-steps", "2", "--data", f"{data},{data}",
                "--report", str(again)])
    assert rc == 0 and json.loads(again.read_text())["sequences"] == 2 * r["sequences"]

    # --init goes on from a written draft: with no time to train, the same weights come out
    # (its config fixes the shape: --layers 3 is overridden)
    rc = train(["--target", str(target), "--out", str(tmp_path / "cont"), *SMALL, "--seconds",
                "0", "--data", str(data), "--init", str(out), "--layers", "3"])
    assert rc == 0
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "cont" /
                                                                    "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # weights that do not fit the draft its config describes are refused by name
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["fc.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(SystemExit, match="(?s)--init .*bad: cannot load its weights.*fc.weight"):
        train(["--target", str(target), "--out", str(tmp_path / "x"), *SMALL, "--data",
               str(data), "--init", str(bad)])
    # a draft of another target is refused by name
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "num_target_layers": 99}))
    with pytest.raises(SystemExit, match="--init: .*trained for a target of 99 layers"):
        train(["--target", str(target), "--out", str(tmp_path / "x"), *SMALL, "--data",
               str(data), "--init", str(out)])


def test_sequence_files_round_trip_and_bad_ones_are_refused(tmp_path, capsys):
    path = tmp_path / "s.safetensors"
    sets = {"train": ([[1, 2, 3], [70000, 5]], [1, 2]), "val": ([[4, 5, 6, 7]], [2])}
    save_sequences(path, sets)
    assert load_sequences(path) == sets
    (tmp_path / "junk").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="junk: not a sequence file"):
        load_sequences(tmp_path / "junk")
    bad = tmp_path / "bad.safetensors"
    save_file({"train.tokens": torch.arange(5), "train.lengths": torch.tensor([3, 3]),
               "train.starts": torch.tensor([1, 1])}, str(bad))
    with pytest.raises(ValueError, match="bad.safetensors: set 'train': tokens, lengths and "
                                         "starts disagree"):
        load_sequences(bad)
    save_file({"train.tokens": torch.arange(5)}, str(bad))
    with pytest.raises(ValueError, match="set 'train' lacks"):
        load_sequences(bad)
    for bad_part in ("2/2", "1", "a/b"):
        with pytest.raises(SystemExit, match="2"):  # argparse's usage error
            train(["--target", "x", "--part", bad_part])
        err = capsys.readouterr().err
        assert "argument --part: " in err and repr(bad_part) in err
    with pytest.raises(SystemExit, match="--data: .*junk: not a sequence file"):
        train(["--target", str(write_tiny_checkpoint(tmp_path / "t", "llama")), "--data",
               str(tmp_path / "junk"), "--device", "cpu"])
