"""Seeded random weights (`random:NAME`): a seed names one set of tensors, on a CPU too."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.random_weights import RandomCheckpoint, chain_successor
from layersplit.shards.tiny import write_tiny_checkpoint


def test_seeds_give_different_tensors_and_a_seed_the_same(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    name, shape = "model.layers.0.mlp.down_proj.weight", (8, 16)

    def draw(seed: int) -> torch.Tensor:
        return RandomCheckpoint(folder, seed).tensor(name, shape, torch.float32, "cpu")

    assert torch.equal(draw(0), draw(0)) and torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(0), draw(1))
    assert not torch.equal(draw(1), draw(2))  # (a seed's high bits alone once told them apart)


def _chain_folder(tmp_path, family: str):
    import json

    from layersplit.shards.tiny import write_tiny_hybrid
    if family == "qwen3_5":
        folder = write_tiny_hybrid(tmp_path / family, family, tie_word_embeddings=False)
    else:
        folder = write_tiny_checkpoint(tmp_path / family, family=family)
    (folder / "random.json").write_text(json.dumps({"weights": "chain"}))
    return folder


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_weights_decode_their_chain_at_every_position(tmp_path, family, dtype):
    """A chain shape's greedy next token is succ[token] at every position of a long prompt, in
    bfloat16 too (the bench oracle's table then holds for a verify step as for a plain one);
    the same shape's Gaussian weights do not follow it."""
    folder = _chain_folder(tmp_path, family)
    ckpt = open_checkpoint(f"random:{folder}", seed=3)
    assert isinstance(ckpt, RandomCheckpoint) and ckpt.chain
    vocab = ckpt.config.vocab_size
    succ = chain_successor(vocab, 3)
    assert sorted(succ.tolist()) == list(range(vocab))
    ids = torch.randint(0, vocab, (96,), generator=torch.Generator().manual_seed(1))
    ex = RangeExecutor(load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype), max_len=128)
    top = torch.cat([ex.run(ids[a:a + 32], a, all_logits=True) for a in range(0, 96, 32)])
    assert torch.equal(top.argmax(-1), succ[ids])
    (folder / "random.json").unlink()  # the same shape, Gaussian weights
    plain = open_checkpoint(f"random:{folder}", seed=3)
    ex = RangeExecutor(load_layer_range(plain, 0, plain.config.num_layers, dtype), max_len=128)
    assert not torch.equal(ex.run(ids[:32], 0, all_logits=True).argmax(-1), succ[ids[:32]])


def test_chain_shapes_are_their_base_shapes():
    """The bench's chain presets are the published shapes they name, value for value."""
    import json

    from layersplit.shards.random_weights import PRESETS_DIR
    for base in ("qwen3-8b", "qwen3.5-27b"):
        chain = PRESETS_DIR / f"{base}-chain"
        assert json.loads((chain / "config.json").read_text()) == \
            json.loads((PRESETS_DIR / base / "config.json").read_text())
        assert RandomCheckpoint(chain).chain and not RandomCheckpoint(PRESETS_DIR / base).chain


@pytest.mark.parametrize("spec, says", [
    ('{"weights": "gaussian"}', "the only choice"),
    ('{"weights": "chain", "scale": 2}', "the only choice"),
    ("weights: chain", "not JSON"),
])
def test_a_bad_random_spec_is_refused_by_name(tmp_path, spec, says):
    folder = write_tiny_checkpoint(tmp_path / "t", family="qwen2")
    (folder / "random.json").write_text(spec)
    with pytest.raises(CheckpointError, match=says) as e:
        RandomCheckpoint(folder)
    assert "random.json" in str(e.value)


def test_chain_weights_refuse_a_tied_head(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "t", family="qwen3")  # (tie_word_embeddings)
    (folder / "random.json").write_text('{"weights": "chain"}')
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        RandomCheckpoint(folder)


def test_prefix_cache_identity_tells_chain_weights_and_seeds_apart(tmp_path):
    """A disk prefix cache keyed by a random shape's weights: another seed, or the same folder
    with chain weights (`random.json`), holds other tensors and so other KV rows."""
    from layersplit.runtime.prefix_keys import weights_identity
    folder = write_tiny_checkpoint(tmp_path / "t", family="qwen2")
    spec = f"random:{folder}"
    gaussian = weights_identity(spec)
    assert weights_identity(spec, 1) != gaussian and weights_identity(spec) == gaussian
    (folder / "random.json").write_text('{"weights": "chain"}')
    assert weights_identity(spec) != gaussian
    assert weights_identity("random:qwen3-8b") != weights_identity("random:qwen3-8b-chain")


def test_chain_weights_refuse_post_normed_writers(tmp_path):
    """Gemma 3 norms o_proj's and down_proj's outputs before the residual add, which undoes
    chain weights' scale (its greedy tokens then leave the chain)."""
    import json
    folder = write_tiny_checkpoint(tmp_path / "g", family="gemma3_text")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    (folder / "random.json").write_text('{"weights": "chain"}')
    with pytest.raises(CheckpointError, match="sandwich norms"):
        RandomCheckpoint(folder)
