"""Our model equals HF transformers on tiny random checkpoints, whole and split into ranges."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.tiny import FAMILY_CONFIGS

from tests.helpers import token_ids

transformers = pytest.importorskip("transformers")  # a declared test dependency



def _chunked_logits(ex: RangeExecutor, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([ex.run(ids[a:a + chunk], a, all_logits=True)
                      for a in range(0, len(ids), chunk)])


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    ckpt = open_checkpoint(path)
    ex = RangeExecutor(load_layer_range(ckpt, 0, ckpt.config.num_layers), max_len=256)
    ids = token_ids(70)
    ours = _chunked_logits(ex, ids, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert ours.shape == ref.shape
    # 1e-5 per unit of logit: float32 rounding of logits that reach ~10 (the tiny models'
    # weights are large enough that every layer matters) moves them by about 1e-5
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() < tol


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("split", [(0, 2, 4, 6), (0, 1, 6), (0, 5, 6)])
def test_range_by_range_equals_whole(tiny_models, family, split):
    ckpt = open_checkpoint(tiny_models[family])
    whole = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=128)
    parts = [RangeExecutor(load_layer_range(ckpt, a, b), max_len=128)
             for a, b in zip(split[:-1], split[1:])]
    assert parts[0].model.embed_tokens is not None and parts[0].model.lm_head is None
    assert parts[-1].model.lm_head is not None and parts[-1].model.embed_tokens is None
    ids = token_ids(40, seed=2)
    for a in range(0, 40, 16):  # prefill chunks, then two decode steps
        x = ids[a:a + 16]
        for p in parts:
            x = p.run(x, a, all_logits=True)
        assert torch.equal(x, whole.run(ids[a:a + 16], a, all_logits=True))
    for pos in (40, 41):
        x = torch.tensor([7])
        for p in parts:
            x = p.run(x, pos)
        assert torch.equal(x, whole.run(torch.tensor([7]), pos))


def test_only_needed_tensors_are_loaded(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    mid = load_layer_range(ckpt, 2, 4)
    names = {n for n, _ in mid.named_parameters()}
    assert all(n.startswith(("layers.0.", "layers.1.")) for n in names), names
    last = load_layer_range(ckpt, 4, 6)
    # tied embeddings: the last range's head is the embedding matrix
    emb = load_layer_range(ckpt, 0, 1).embed_tokens.weight
    assert torch.equal(last.lm_head.weight, emb)


def test_static_decode_path_matches_eager(tiny_models):
    """The CUDA-graph step (static buffers, device-side position, bucketed masked attention,
    grouped GQA) run without capture on CPU gives the eager path's tokens and logits."""
    for family in ("llama", "qwen3", "qwen2", "mistral-window", "qwen2-window", "gemma3_text",
                   "glm4_moe", "gpt_oss"):
        ckpt = open_checkpoint(tiny_models[family])
        eager = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=96, static_decode=False)
        static = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=96, static_decode=True,
                               graph_bucket=32)
        ids = token_ids(20, seed=3)
        for ex in (eager, static):
            ex.run(ids, 0)
        ta = tb = int(ids[-1])
        for pos in range(20, 80):  # crosses two bucket boundaries
            la = eager.run(torch.tensor([ta]), pos)
            lb = static.run(torch.tensor([tb]), pos)
            assert (la - lb).abs().max().item() < 5e-5
            ta, tb = int(la.argmax()), int(lb.argmax())
            assert ta == tb
        # (the two paths' attention differs by float32 rounding: 1.4e-5 on an AVX-512 / AMX
        # host, where the bound of 1e-5 once held)
        assert torch.allclose(eager.kv.k[:, :, :80], static.kv.k[:, :, :80], atol=5e-5)


def test_fused_projections_equal_separate(tiny_models):
    """The GPU layout (one q/k/v matmul, one gate/up matmul, the fused decode functions run
    uncompiled) gives the separate-weights path's logits on CPU (to float32 rounding: the
    tiny models' logits reach ~10)."""
    from layersplit.shards.fused import fuse_projections

    for family in ("llama", "qwen2", "qwen3", "mistral-window", "gemma3_text", "glm4_moe",
                   "gpt_oss"):
        ckpt = open_checkpoint(tiny_models[family])
        plain = RangeExecutor(load_layer_range(ckpt, 0, 6), 96, static_decode=True,
                              graph_bucket=32)
        model = load_layer_range(ckpt, 0, 6)
        fuse_projections(model, compile=False)
        fused = RangeExecutor(model, 96, static_decode=True, graph_bucket=32)
        ids = token_ids(20, seed=4)
        assert (plain.run(ids, 0) - fused.run(ids, 0)).abs().max().item() < 5e-5
        for pos in range(20, 40):
            a, b = plain.run(torch.tensor([9]), pos), fused.run(torch.tensor([9]), pos)
            assert (a - b).abs().max().item() < 5e-5
        # a verify step of a token tree: several query rows per KV head (`group_queries`)
        rows = torch.tensor([9, 3, 5, 7, 2])
        a, b = (ex.run(rows, 40, all_logits=True, verify=True, tree=[0, 1, 1, 0])
                for ex in (plain, fused))
        assert a.shape[0] == 5 and (a - b).abs().max().item() < 5e-5


@pytest.mark.parametrize("family", ["mistral-window", "llama", "deepseek_v3", "gpt_oss"])
def test_tree_verify_rows_equal_their_paths(tiny_models, family):
    """Each row of a token-tree verify step gives the logits of its root-to-node path run as a
    plain chain: the tree's mask (ancestors only, and in a sliding window the ancestors'
    positions, not their KV rows) is right. Eager and static steps alike."""
    from layersplit.shards.spec_tree import ancestors

    ckpt = open_checkpoint(tiny_models[family])
    ids, pos = token_ids(40, seed=5), 40
    rows = torch.tensor([9, 3, 5, 7, 2, 11, 4])
    parents = [0, 1, 1, 3, 0, 5]  # depths 1, 2, 2, 3, 1, 2: deeper than the window's slack
    anc = ancestors(parents)
    for static in (False, True):
        tree_ex = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=96, static_decode=static,
                                graph_bucket=32)
        tree_ex.run(ids, 0)
        got = tree_ex.run(rows, pos, all_logits=True, verify=True, tree=parents)
        for j in range(len(rows)):
            path = [i for i in range(len(rows)) if anc[j, i]]
            chain_ex = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=96)
            chain_ex.run(ids, 0)
            want = chain_ex.run(rows[path], pos, all_logits=True)[-1]
            assert (got[j] - want).abs().max().item() < 5e-5, (static, j)


@pytest.mark.parametrize("family,kept", [
    ("glm4_moe", ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")),
    ("gpt_oss", ("layernorm.weight", "norm.weight"))])
def test_tensors_kept_in_float32(tiny_models, family, kept):
    """In a half dtype, GLM's router and gpt-oss's norms stay float32, as transformers keeps
    them; our bfloat16 logits are as close to transformers' float32 ones as its own bfloat16
    logits are (mean error within 1.5 x)."""
    path = tiny_models[family]
    model = load_layer_range(open_checkpoint(path), 0, 6, torch.bfloat16)
    f32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert f32 and all(n.endswith(kept) for n in f32)
    assert sum(n.endswith(kept) for n, _ in model.named_parameters()) == len(f32)
    ids = token_ids(24, seed=7)
    ours = RangeExecutor(model, max_len=64).run(ids, 0, all_logits=True)
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            refs[dtype] = hf(ids[None]).logits[0].float()
    theirs = (refs[torch.bfloat16] - refs[torch.float32]).abs().mean().item()
    assert (ours - refs[torch.float32]).abs().mean().item() <= 1.5 * theirs


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_saved_by_transformers_matches_range_by_range(tmp_path, family):
    """A checkpoint built and written by transformers' own classes (its tensor names and
    layout, its config.json; the routers' correction biases and gpt-oss's sinks random too),
    run whole and as 2 and 3 ranges: prefill chunks, then one-token steps (MLA's absorbed
    form), every position's logits equal transformers' own within 1e-5."""
    raw = {k: v for k, v in FAMILY_CONFIGS[family].items() if k != "architectures"}
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw, num_hidden_layers=4,
                                            vocab_size=320, eos_token_id=2, pad_token_id=0,
                                            bos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    assert all(b.abs().sum() > 0 for n, b in hf.named_buffers() if "correction" in n)
    hf.save_pretrained(tmp_path)
    ids = token_ids(48, seed=6)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.config.model_type == family and ckpt.config.num_layers == 4
    for split in ((0, 4), (0, 2, 4), (0, 1, 3, 4)):
        parts = [RangeExecutor(load_layer_range(ckpt, a, b), max_len=64)
                 for a, b in zip(split[:-1], split[1:])]
        got = []
        for a, b in [(0, 16), (16, 32), (32, 40)] + [(p, p + 1) for p in range(40, 48)]:
            x = ids[a:b]
            for p in parts:
                x = p.run(x, a, all_logits=True)
            got.append(x)
        err = (torch.cat(got) - ref).abs().max().item()
        assert err < 1e-5 * max(1.0, ref.abs().max().item()), (split, err)
