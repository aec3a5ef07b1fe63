"""The family shapes the GPU parity checks use, shrunk to CPU widths: written by transformers,
read by our loader, and equal to transformers float32 through the split runtime."""

from __future__ import annotations

import json

import pytest
from layersplit.runtime.check import CheckOptions, run_check
from layersplit.runtime.config import RuntimeConfig
from layersplit.shards.shape_checkpoints import SHAPES, write_shape_checkpoint

pytest.importorskip("transformers")  # a declared test dependency

_NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512)
SMALL = {
    "llama": _NARROW,
    "smollm2": {**_NARROW, "num_hidden_layers": 4},
    "qwen3": {**_NARROW, "head_dim": 16},
    "qwen3_5": {**_NARROW, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16},
    "qwen3_moe": {**_NARROW, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                  "num_experts_per_tok": 4},
    "gemma3": {**_NARROW, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},
    "mistral": {**_NARROW, "sliding_window": 16},
    "deepseek_v3": {**_NARROW, "num_key_value_heads": 4, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 4,
                    "topk_group": 2, "num_experts_per_tok": 3},
    "gpt_oss": {**_NARROW, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
                "sliding_window": 16, "pad_token_id": None},
    "glm4_moe": {**_NARROW, "head_dim": 16, "moe_intermediate_size": 32,
                 "n_routed_experts": 8, "num_experts_per_tok": 4, "pad_token_id": None},
}


def test_every_shape_has_a_cpu_size():
    assert set(SMALL) == set(SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_shape_checkpoint_matches_transformers(tmp_path, family):
    path = write_shape_checkpoint(tmp_path / family, family, "cpu", **SMALL[family])
    cfg = RuntimeConfig(model=str(path), devices=("cpu", "cpu"), max_context=512,
                        prefill_chunk=16, threads=1)
    r = run_check(cfg, CheckOptions(limit=2, new_tokens=12))
    assert r["pass"], r["failures"]
    assert r["top1_agreement"] == 1.0 and r["greedy_equal"] == 2


# the families whose bfloat16 layers on the CPU are transformers' own, operation for operation
# (the other families' bfloat16 outputs are not transformers' bit for bit: not pinned here)
SAME_BF16 = ("llama", "qwen3", "qwen3_5", "qwen3_moe", "glm4_moe")


@pytest.mark.parametrize("family", SAME_BF16)
def test_bfloat16_rounds_where_transformers_does(tmp_path, family):
    """Where a bfloat16 run departs from float32, ours departs as transformers' does: a
    prompt's prefill then decode steps give transformers' bfloat16 logits, and each layer's
    output, bit for bit (an extra rounding anywhere, or one fewer, shows at once)."""
    import torch
    from layersplit.runtime.check_reference import load_transformers
    from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
    from layersplit.shards.executor import RangeExecutor

    hf = load_transformers(write_shape_checkpoint(tmp_path / family, family, "cpu",
                                                  **SMALL[family]), "cpu", "bfloat16")
    g = torch.Generator().manual_seed(0)
    for name, p in hf.named_parameters():  # (norm weights other than 1: their product rounds)
        if "norm" in name:
            p.data *= (1 + 0.3 * torch.randn(p.shape, generator=g)).to(p.dtype)
    hf.save_pretrained(tmp_path / "w")
    ckpt = open_checkpoint(tmp_path / "w")
    layers = ckpt.config.num_layers
    ours = RangeExecutor(load_layer_range(ckpt, 0, layers, torch.bfloat16, "cpu"), max_len=64,
                         taps=tuple(range(layers)))
    seq = torch.randint(0, 320, (28,), generator=g).tolist()  # a 24-token prompt, 4 steps
    past, pos = None, 0
    for ids in [seq[:24]] + [[t] for t in seq[24:]]:
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True,
                      output_hidden_states=True)
        past = want.past_key_values
        taps: dict[int, torch.Tensor] = {}
        got = ours.run(torch.tensor(ids), pos, all_logits=True, taps=taps)
        pos += len(ids)
        assert torch.equal(got, want.logits[0].float()), f"logits at {pos}"
        for i in range(layers):  # (HF's last hidden state is after the final norm, as taps')
            assert torch.equal(taps[i], want.hidden_states[i + 1][0]), f"layer {i} at {pos}"


def test_a_folder_written_from_another_config_is_written_again(tmp_path):
    """A shape's folder is reused only where it was written from the same config and seed: the
    shape table changing (a field overridden, say) writes it again; a folder that holds anything
    but a checkpoint's files is refused, never removed."""
    small = SMALL["llama"]
    path = write_shape_checkpoint(tmp_path / "llama", "llama", "cpu", **small)
    first = (path / "model.safetensors").stat().st_mtime_ns
    assert write_shape_checkpoint(path, "llama", "cpu", **small) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == first  # (reused)
    write_shape_checkpoint(path, "llama", "cpu", **{**small, "tie_word_embeddings": True})
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a shape checkpoint's folder"):
        write_shape_checkpoint(tmp_path / "mine", "llama", "cpu", **small)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
