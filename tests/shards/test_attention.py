"""The torch decode attention (`Attention._grouped`, `_grouped_batch`: the path of a captured
step where the fused decode kernel does not run, as GLM's partial rotary) in bfloat16: its
scores stay float32, as flash attention's and the decode kernels' do."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers.attention import Attention, attend, group_queries
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.tiny import FAMILY_CONFIGS


@pytest.mark.parametrize("rows", [1, 3])
def test_bfloat16_decode_attention_is_as_close_as_sdpa(rows):
    """Against float64 attention of the same bfloat16 q, k and v, the grouped decode paths err
    no more than 1.5 x SDPA's (flash attention, the eager path's and transformers'). Scores
    rounded to bfloat16 (a score of 20 by up to 0.06) erred ~5 x as much."""
    raw = {**FAMILY_CONFIGS["glm4_moe"], "num_hidden_layers": 2, "vocab_size": 320}
    att = Attention(config_from_hf(raw, "glm4_moe"), 0)  # (4 query heads over 2 KV heads)
    h, g_, d, t = att.num_heads, att.num_kv_heads, att.head_dim, 40
    gen = torch.Generator().manual_seed(rows)
    q = (2 * torch.randn(rows, h, d, generator=gen)).to(torch.bfloat16)  # (scores of ~20)
    k = (2 * torch.randn(t, g_, d, generator=gen)).to(torch.bfloat16)
    v = torch.randn(t, g_, d, generator=gen).to(torch.bfloat16)
    mask = torch.ones(rows, t, dtype=torch.bool)
    mask[:, :3] = False  # (masked keys, as a window's)
    truth = attend(q.double(), k.double(), v.double(), mask, False, None)

    def err(out: torch.Tensor) -> float:
        return (out.double() - truth).abs().mean().item()

    sdpa = err(attend(q, k, v, mask, False, None))
    assert sdpa > 0
    grouped = att._grouped(group_queries(q, g_), k, v, mask)
    batched = att._grouped_batch(q, k[None], v[None], mask)  # (one sequence of `rows` rows)
    assert grouped.dtype == batched.dtype == torch.bfloat16
    assert err(grouped) <= 1.5 * sdpa, (err(grouped), sdpa)
    assert err(batched) <= 1.5 * sdpa, (err(batched), sdpa)
