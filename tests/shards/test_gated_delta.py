"""The Gated DeltaNet layer and the gated-attention pieces equal transformers' own (qwen3_next,
qwen3_5) on tiny random configs: prefill longer than one chunk, then decode steps."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers.gated_attention import apply_partial_rope, split_query_gate
from layersplit.shards.layers.gated_delta import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
            num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16)


def _hf_layer(family: str):
    torch.manual_seed(0)
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        cfg = transformers.Qwen3NextConfig(**TINY, num_experts=0)
        layer = m.Qwen3NextGatedDeltaNet(cfg, 0)
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        cfg = transformers.Qwen3_5TextConfig(**TINY)
        layer = m.Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():  # nothing left at its init: every weight shows
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log) * 2 - 1)
    return cfg, layer.eval()


def _ours(cfg, hf_layer) -> GatedDeltaNet:
    ours = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                         cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                         cfg.linear_conv_kernel_dim, cfg.rms_norm_eps,
                         fused_projections=cfg.model_type == "qwen3_next")
    ours.load_state_dict(hf_layer.state_dict(), strict=True)
    return ours


def _fresh(ours: GatedDeltaNet, b: int = 1):
    return torch.zeros(b, *ours.conv_state_shape()), torch.zeros(b, *ours.state_shape())


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_layer_matches_transformers_prefill_then_decode(family):
    cfg, hf = _hf_layer(family)
    ours = _ours(cfg, hf)
    x = torch.randn(1, 150, cfg.hidden_size)  # over two chunks of 64
    cache = transformers.DynamicCache(config=cfg)
    conv, state = _fresh(ours)
    with torch.no_grad():
        ref = hf(x[:, :147], cache_params=cache)
        out, _ = ours(x[:, :147], conv, state)
        assert (out - ref).abs().max().item() < 1e-5
        for t in range(147, 150):  # decode: HF's recurrent path
            ref = hf(x[:, t:t + 1], cache_params=cache)
            out, _ = ours(x[:, t:t + 1], conv, state)
            assert (out - ref).abs().max().item() < 1e-5
        assert (state - cache.layers[0].recurrent_states[0]).abs().max().item() < 1e-5
        assert torch.equal(conv, cache.layers[0].conv_states[0][..., 1:])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_chunks_then_decode_equal_one_prefill(family):
    cfg, hf = _hf_layer(family)
    ours = _ours(cfg, hf)
    x = torch.randn(1, 140, cfg.hidden_size)
    with torch.no_grad():
        whole, _ = ours(x, *_fresh(ours))
        conv, state = _fresh(ours)
        parts = [ours(x[:, a:b], conv, state)[0] for a, b in ((0, 70), (70, 137))]
        parts += [ours(x[:, t:t + 1], conv, state)[0] for t in range(137, 140)]
    assert (torch.cat(parts, dim=1) - whole).abs().max().item() < 1e-5


def test_recurrent_and_chunked_rule_agree_and_keep_every_row():
    g = torch.Generator().manual_seed(3)
    b, n, hk, hv, dk, dv = 2, 70, 2, 4, 8, 5
    q, k = torch.randn(b, n, hk, dk, generator=g), torch.randn(b, n, hk, dk, generator=g)
    v = torch.randn(b, n, hv, dv, generator=g)
    gate = -torch.rand(b, n, hv, generator=g)
    beta = torch.rand(b, n, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, gate, beta, s0, chunk_size=16)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, gate, beta, s0)
    assert (out_c - out_r).abs().max().item() < 1e-5
    assert (s_c - s_r).abs().max().item() < 1e-5
    _, rows = recurrent_gated_delta_rule(q, k, v, gate, beta, s0, keep_states=True)
    assert torch.equal(rows[:, -1], s_r)
    _, s_half = recurrent_gated_delta_rule(q[:, :30], k[:, :30], v[:, :30], gate[:, :30],
                                           beta[:, :30], s0)
    assert torch.equal(rows[:, 29], s_half)


def test_kept_rows_are_the_states_of_each_prefix():
    cfg, hf = _hf_layer("qwen3_5")
    ours = _ours(cfg, hf)
    x = torch.randn(1, 9, cfg.hidden_size)
    with torch.no_grad():
        conv, state = _fresh(ours)
        ours(x[:, :5], conv, state)
        c0, s0 = conv.clone(), state.clone()
        _, (convs, states) = ours(x[:, 5:9], conv, state, keep_states=True)
        assert torch.equal(conv, c0) and torch.equal(state, s0)  # left as they were
        for j in range(4):  # accepting j + 1 rows: decode those rows one by one
            c, s = c0.clone(), s0.clone()
            for t in range(5, 6 + j):
                ours(x[:, t:t + 1], c, s)
            # one n-row projection need not round like n one-row ones: close, not equal
            assert (convs[:, j] - c).abs().max().item() < 1e-6
            assert (states[:, j] - s).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gated_attention_pieces_match_transformers(family):
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        cfg = transformers.Qwen3NextConfig(**{**TINY, "layer_types": ["full_attention"]},
                                           num_experts=0)
        attn_cls, rope_cls = m.Qwen3NextAttention, m.Qwen3NextRotaryEmbedding
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        cfg = transformers.Qwen3_5TextConfig(**{**TINY, "layer_types": ["full_attention"]})
        attn_cls, rope_cls = m.Qwen3_5Attention, m.Qwen3_5TextRotaryEmbedding
    torch.manual_seed(1)
    attn = attn_cls(cfg, 0).eval()
    rope = rope_cls(cfg)
    x = torch.randn(1, 5, cfg.hidden_size)
    pos = torch.arange(3, 8)[None]
    cos, sin = rope(x, pos)
    assert cos.shape[-1] == int(cfg.head_dim * 0.25)  # partial rotary by default
    q, gate = split_query_gate(attn.q_proj(x[0]), cfg.num_attention_heads, cfg.head_dim)
    q_ref, gate_ref = torch.chunk(attn.q_proj(x).view(1, 5, -1, 2 * cfg.head_dim), 2, dim=-1)
    assert torch.equal(q, q_ref[0]) and torch.equal(gate, gate_ref.reshape(1, 5, -1)[0])
    k = torch.randn(5, 1, cfg.head_dim)
    q_rot, k_rot = m.apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                          cos, sin)
    assert torch.equal(apply_partial_rope(q, cos[0], sin[0]), q_rot[0].transpose(0, 1))
    assert torch.equal(apply_partial_rope(k, cos[0], sin[0]), k_rot[0].transpose(0, 1))
