"""Multi-head latent attention (`deepseek_v3`, `kimi_k2`): decode steps in the absorbed form
against transformers, over a contiguous and a paged cache of latent rows, eager and static;
the cache's bytes per token; the config fields refused by name. (Prefill parity, range by range
and tree verify steps: tests/shards/test_model_parity.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.kv_pool import kv_pool_blocks
from layersplit.runtime.placement import Placement, ShardPlan
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.tiny import FAMILY_CONFIGS

transformers = pytest.importorskip("transformers")  # a declared test dependency

FAMILIES = ("deepseek_v3", "deepseek_v3-noq")
PROMPT, NEW = 40, 8


def _executor(path, static: bool, paged: bool) -> RangeExecutor:
    ckpt = open_checkpoint(path)
    model = load_layer_range(ckpt, 0, ckpt.config.num_layers)
    if not paged:
        return RangeExecutor(model, 64, static_decode=static, graph_bucket=32)
    ex = RangeExecutor(model, 64, 2, static_decode=static, graph_bucket=32, paged=(9, 8))
    ex.kv.set_table(1, 0, [7, 2, 5, 0, 8, 1, 3, 4])  # blocks out of order, slot 1
    return ex


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers(tiny_models, family):
    """A prompt in chunks (the decompressed form), then one-token steps (the absorbed form):
    every step's logits equal transformers' on the whole sequence, in each cache and path."""
    path = tiny_models[family]
    ids = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(7))
    first = _executor(path, static=False, paged=False)
    first.run(ids[:24], 0)
    logits = [first.run(ids[24:], 24)]
    for pos in range(PROMPT, PROMPT + NEW):
        tok = int(logits[-1].argmax())
        ids = torch.cat([ids, torch.tensor([tok])])
        logits.append(first.run(torch.tensor([tok]), pos))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, PROMPT - 1:]
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (torch.cat(logits) - ref).abs().max().item() < tol
    for static, paged in ((True, False), (False, True), (True, True)):
        ex = _executor(path, static, paged)
        slot = 1 if paged else 0
        ex.run(ids[:PROMPT], 0, slot)
        for pos in range(PROMPT, PROMPT + NEW):
            out = ex.run(ids[pos:pos + 1], pos, slot)
            assert (out[0] - ref[pos - PROMPT + 1]).abs().max().item() < tol, (static, paged)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_holds_latent_rows_only(tiny_models, family):
    """KV bytes per token <= 1.05 x (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes
    (the odd latent of `deepseek_v3-noq` pads one column): in a contiguous cache, in the paged
    pool a shard allocates, and in the blocks a KV budget buys."""
    ex = _executor(tiny_models[family], static=False, paged=False)
    m, layers = ex.model.cfg.mla, ex.model.num_layers
    per_token = ex.kv.nbytes / (ex.kv.max_len + 1)  # (one slot; the scratch row included)
    assert per_token <= 1.05 * m.latent_width * layers * 4
    assert ex.model.cfg.kv_bytes_per_token(layers, 4) == per_token
    # the paged pool a shard serves from (9 blocks of 8 tokens and the scratch block), and
    # the blocks `kv_cache_gb` buys (`runtime.kv_pool`)
    pool = _executor(tiny_models[family], static=False, paged=True).kv
    assert pool.nbytes / (10 * 8) <= 1.05 * m.latent_width * layers * 4
    config = RuntimeConfig(model="m", devices=("cpu", "cpu"), kv_cache_gb=1 / 1024, kv_block=8)
    placement = Placement((ShardPlan(0, 0, 4, "cpu", None), ShardPlan(1, 4, layers, "cpu", None)),
                          ("shm",))
    blocks = kv_pool_blocks(config, ex.model.cfg, placement, 4)  # (4 layers on shard 0)
    assert (blocks + 1) * 8 >= 2**20 / (1.05 * m.latent_width * 4 * 4)


def test_kimi_k2_is_deepseek_v3(tiny_models, tmp_path):
    src = tiny_models["deepseek_v3"]
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    raw = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**raw, "model_type": "kimi_k2"}))
    ids = torch.arange(5, 30)
    a, b = (_executor(p, static=False, paged=False).run(ids, 0, all_logits=True)
            for p in (src, kimi))
    assert torch.equal(a, b)


@pytest.mark.parametrize("field,value", [
    ("topk_method", "greedy"),  # DeepSeek-V2's routing
    ("scoring_func", "softmax"),
    ("moe_layer_freq", 2),
    ("index_topk", 2048),  # DeepSeek-V3.2's sparse-attention indexer
    ("quantization_config", {"quant_method": "awq"}),  # (FP8 loads: test_fp8_checkpoint.py)
    ("num_key_value_heads", 1),
    ("qk_head_dim", 99),
])
def test_unimplemented_fields_are_refused_by_name(field, value):
    raw = {**FAMILY_CONFIGS["deepseek_v3"], "num_hidden_layers": 4, "vocab_size": 320,
           field: value}
    with pytest.raises(CheckpointError, match=field):
        config_from_hf(raw, "config.json")


def test_inert_fields_are_accepted():
    """Router losses, expert parallelism and the multi-token-prediction layer change nothing
    the runtime computes."""
    raw = {**FAMILY_CONFIGS["deepseek_v3"], "num_hidden_layers": 4, "vocab_size": 320,
           "ep_size": 1, "seq_aux": True, "num_nextn_predict_layers": 1, "moe_layer_freq": 1}
    assert config_from_hf(raw, "config.json").mla is not None


@pytest.mark.parametrize("change", [
    {"attention_bias": True},  # q_a_proj, kv_a_proj_with_mqa and o_proj biased
    {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,  # Kimi K2's routing
     "rope_scaling": None, "first_k_dense_replace": 0},
], ids=["attention-bias", "kimi-routing"])
def test_saved_by_transformers_matches(tmp_path, change):
    """A checkpoint built and written by transformers' own `DeepseekV3ForCausalLM`: prefill
    and decode logits equal its own."""
    raw = {k: v for k, v in FAMILY_CONFIGS["deepseek_v3"].items()
           if k not in ("architectures", "model_type")}
    cfg = transformers.DeepseekV3Config(**{**raw, **change}, num_hidden_layers=3,
                                        vocab_size=320, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
        for layer in hf.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2))
    ex = _executor(tmp_path, static=False, paged=False)
    ours = [ex.run(ids[:-2], 0, all_logits=True)] + [ex.run(ids[p:p + 1], p) for p in (28, 29)]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (torch.cat(ours) - ref).abs().max().item() < tol


@pytest.mark.parametrize("field", ["routed_scaling_factor", "first_k_dense_replace",
                                   "n_shared_experts", "q_lora_rank", "norm_topk_prob",
                                   "rope_interleave"])
def test_a_missing_field_reads_as_transformers_default(field):
    """A config.json without the field means transformers' `DeepseekV3Config` default, not 0
    or 1 (a wrong routing scale would be silently wrong logits)."""
    raw = {k: v for k, v in FAMILY_CONFIGS["deepseek_v3"].items() if k != field}
    raw.update(num_hidden_layers=4, vocab_size=320)
    hf = transformers.DeepseekV3Config(**{k: v for k, v in raw.items()
                                          if k not in ("architectures", "model_type")})
    cfg = config_from_hf(raw, "config.json")
    assert cfg.group_routing.routed_scaling_factor == hf.routed_scaling_factor
    assert cfg.dense_layers == tuple(range(min(hf.first_k_dense_replace, 4)))
    assert cfg.shared_expert_intermediate_size == hf.moe_intermediate_size * hf.n_shared_experts
    assert cfg.mla.q_lora_rank == (hf.q_lora_rank or 0)
    assert cfg.norm_topk_prob == hf.norm_topk_prob
    assert cfg.mla.rope_interleave == hf.rope_interleave


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-noq"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_input_projection_equals_the_two(family, bias):
    """`MLAttention.fuse` (a GPU's layout: the query, or its bottleneck, and the latent
    projection as one matmul) gives the queries and latent rows the two projections give,
    biases included (q_proj has none where kv_a may)."""
    from layersplit.shards.layers.mla import MLAttention

    raw = {**FAMILY_CONFIGS["deepseek_v3"], "num_hidden_layers": 2, "vocab_size": 320,
           "attention_bias": bias}
    if family.endswith("-noq"):
        raw["q_lora_rank"] = None
    cfg = config_from_hf(raw, "config.json")
    torch.manual_seed(2)
    attn = MLAttention(cfg)
    for p in attn.parameters():
        p.data.normal_(0.0, 0.1)
    x = torch.randn(3, cfg.hidden_size)
    want = attn._project(x)
    attn.fuse()
    assert attn.in_proj is not None and not hasattr(attn, "kv_a_proj_with_mqa")
    for got, ref in zip(attn._project(x), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
