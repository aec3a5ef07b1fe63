"""The DFlash draft model: its checkpoint layout and the errors of a mismatched draft, and that
its three forms compute the same thing: the training forward (many blocks at once under a mask),
the eager proposal, and the fixed-shape step that is captured in a CUDA graph on GPUs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from layersplit.draft.dflash import dflash_tensor_shapes, load_dflash, write_random_dflash
from layersplit.draft.dflash_config import read_dflash_config
from layersplit.draft.measure import block_logits
from layersplit.draft.proposer import DFlashProposer, load_proposer
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.random_weights import PRESETS_DIR
from safetensors import safe_open
from safetensors.torch import load_file, save_file

PRESET = PRESETS_DIR / "qwen3.5-27b-dflash"


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory):
    return write_random_dflash(read_hf_config(tiny_llama), tmp_path_factory.mktemp("dflash"),
                               layers=2, taps=[1, 3, 5], block_size=4)


@pytest.fixture(scope="module", params=["full", "windowed"])
def any_draft(request, draft_dir, tmp_path_factory):
    """The draft, and the same weights with a sliding-window layer (window 6: block rows see
    the keys of their last 6 positions, the block's causally) before a full one, as z-lab's
    Qwen3.5-27B draft has them."""
    if request.param == "full":
        return draft_dir
    return _edit(draft_dir, tmp_path_factory.mktemp("windowed") / "d", lambda r: r.update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6))


def test_published_layout_loads(draft_dir, tiny_llama):
    cfg = read_dflash_config(draft_dir)
    assert cfg.block_size == 4 and cfg.target_layer_ids == (1, 3, 5) and cfg.width == 3 * 64
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(dflash_tensor_shapes(cfg))
        assert "fc.weight" in f.keys() and "layers.1.self_attn.k_norm.weight" in f.keys()
    p = load_proposer(draft_dir, tiny_llama, "cpu", torch.float32, 64)
    assert isinstance(p, DFlashProposer) and p.block_size == 4


def _edit(src, dst, change):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    change(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("change,match", [
    (lambda r: r.update(hidden_size=32), "hidden_size"),
    (lambda r: r.update(vocab_size=999), "vocab_size 999"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 9]), "layer 9"),
    (lambda r: r["dflash_config"].update(mask_token_id=10_000), "mask_token_id"),
    (lambda r: r.update(num_target_layers=30), "30 layers"),
    (lambda r: r.update(block_size=1), "block_size"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[3, 1]), "increasing"),
])
def test_mismatched_draft_is_refused(draft_dir, tiny_llama, tmp_path, change, match):
    bad = _edit(draft_dir, tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=match):
        load_proposer(bad, tiny_llama, "cpu", torch.float32, 64)


@pytest.mark.parametrize("tensor,how", [("fc.weight", "missing"), ("norm.weight", "shape")])
def test_bad_tensors_are_named(draft_dir, tiny_llama, tmp_path, tensor, how):
    bad = tmp_path / "bad"
    shutil.copytree(draft_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    if how == "missing":
        del state[tensor]
    else:
        state[tensor] = torch.ones(7)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=tensor):
        load_proposer(bad, tiny_llama, "cpu", torch.float32, 64)


@pytest.mark.parametrize("fused", [False, True])
def test_training_eager_and_static_forms_agree(any_draft, tiny_llama, fused):
    """The training form, the eager proposer and the static one (`draft_step`: the captured
    step, on the weights of separate or fused projections) compute the same logits, with
    sliding-window layers too."""
    from layersplit.shards.fused import fuse_projections

    draft_dir = any_draft
    cfg = read_dflash_config(draft_dir)
    model = load_dflash(draft_dir, cfg, torch.float32, "cpu")
    fused_model = load_dflash(draft_dir, cfg, torch.float32, "cpu")
    if fused:
        fuse_projections(fused_model, compile=False)
    g = torch.Generator().manual_seed(0)
    vocab, hidden, length = 320, 64, 40
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g)
    feats = torch.randn(length, cfg.width, generator=g)
    tokens = torch.randint(0, vocab, (length,), generator=g)
    eager = DFlashProposer(model, embed, head, 64, torch.device("cpu"), graphs=False)
    static = DFlashProposer(fused_model, embed, head, 64, torch.device("cpu"), graphs=True,
                            bucket=16)
    for p in (eager, static):
        p.write_features(0, 0, 0, feats)
    anchors = [5, 6, 9, 17, 30]  # gaps of 1, 3 (inside one block) and 8, 13 (longer)
    trained = block_logits(model, head, embed, feats[None], tokens[None],
                           torch.tensor([anchors]), 4, cfg.mask_token_id)[0]
    for j, a in enumerate(anchors):
        want = trained[j]  # (3, V)
        got_e = eager.logits(0, int(tokens[a]), a, 3)
        got_s = static.logits(0, int(tokens[a]), a, 3)
        assert torch.allclose(got_e, want, atol=1e-4), (a, (got_e - want).abs().max())
        assert torch.allclose(got_s, want, atol=1e-4), (a, (got_s - want).abs().max())
    # a shorter block (near the end of the context) goes the eager way in both
    assert torch.allclose(static.logits(0, int(tokens[33]), 33, 2),
                          eager.logits(0, int(tokens[33]), 33, 2), atol=1e-5)
    # proposals: the static form takes each row's best ids from its own step (top-k in the
    # graph), the eager one from the logits; chains and trees come out the same
    shape = ((0,), (1,), (0, 0), (0, 1), (2,), (0, 0, 0))
    for p in (eager, static):
        p.cfg = dataclasses.replace(cfg, spec_tree=shape)
    for a in anchors:
        for tree in (0, 4, 6):
            want = eager.propose(0, int(tokens[a]), a, 3, tree=tree)
            assert static.propose(0, int(tokens[a]), a, 3, tree=tree) == want, (a, tree)
            assert want[1] is None if tree == 0 else len(want[0]) == tree


def _random_draft(tiny_llama, bias: bool, fused: bool):
    """A 2-layer random draft of the tiny target, with q/k/v biases or not, its projections
    fused (as on GPUs) or not."""
    from layersplit.draft.dflash import DFlashDraft, dflash_config_dict
    from layersplit.draft.dflash_config import read_dflash_config_dict
    from layersplit.shards.fused import fuse_projections

    target = read_hf_config(tiny_llama)
    raw = {**dflash_config_dict(target, layers=2, taps=[1, 4], block_size=4, mask_token_id=0),
           "attention_bias": bias}
    cfg = read_dflash_config_dict(raw, tiny_llama / "config.json")
    torch.manual_seed(0)
    model = DFlashDraft(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    if fused:
        fuse_projections(model, compile=False)
    return model, cfg


@pytest.mark.parametrize("bias,fused", [(False, False), (True, False), (True, True)])
def test_context_of_all_layers_at_once_equals_each_layers(tiny_llama, bias, fused):
    """The captured step's `context_kv_all` (one function for every layer, compiled on GPUs)
    computes what `context_kv` does layer by layer: with q/k/v biases too, and on fused
    projections (GPUs) as on separate ones."""
    from layersplit.draft.dflash import context_kv_all

    model, cfg = _random_draft(tiny_llama, bias, fused)
    feats, pos = torch.randn(5, cfg.width), torch.arange(7, 12)
    m = cfg.model
    with torch.no_grad():
        k, v = context_kv_all(feats, pos, model.fc.weight, model.hidden_norm.weight,
                              model.kv_weights(), model.inv_freq, m.rms_norm_eps,
                              m.num_kv_heads, m.head_dim)
        ctx = model.context(feats)
        for i in range(m.num_layers):
            want_k, want_v = model.context_kv(ctx, pos, i)
            assert torch.allclose(k[i], want_k, atol=1e-5) and torch.allclose(v[i], want_v,
                                                                               atol=1e-5)


@pytest.mark.parametrize("bias,fused,hole", [(False, False, None), (True, False, None),
                                             (True, True, None), (False, False, (2, 6)),
                                             (True, True, (7, 11))])
def test_draft_step_equals_the_eager_block(tiny_llama, bias, fused, hole):
    """`draft_step` (the captured step's function) gives the logits of the eager path
    (`write_context` + `block` + head) and the context keys and values it stores, with q/k/v
    biases too, on fused projections as on separate ones; cached rows past `done` and new
    context rows past the block's position are not seen, nor the rows of a `hole` (rows that
    never came, `DFlashProposer.gap`): junk there, different in each path, changes nothing."""
    from layersplit.draft.dflash import block_step, draft_step, layer_weights
    from layersplit.shards.kv_cache import KVCache, KVLayout

    model, cfg = _random_draft(tiny_llama, bias, fused)
    m = cfg.model
    feats = torch.randn(40, cfg.width)
    embed, head = torch.randn(m.vocab_size, m.hidden_size), torch.randn(m.vocab_size,
                                                                          m.hidden_size)
    done, pos, ids = 9, 12, torch.tensor([5, 0, 0, 0])
    a, b = hole or (0, 0)
    known = torch.ones(48, dtype=torch.bool)
    known[a:b] = False
    layout = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, torch.float32)
    eager, cache = KVCache(layout, 48, 1, "cpu"), KVCache(layout, 48, 1, "cpu")
    with torch.no_grad():
        model.write_context(feats[:pos], 0, eager)
        model.write_context(feats[:done], 0, cache)
        cache.k[:, 0, done:].normal_()  # junk past `done`: must not be seen
        cache.v[:, 0, done:].normal_()
        whole = model.block(F.embedding(ids, embed), block_step(pos, 4, torch.device("cpu")),
                            eager)
        for kv in (eager, cache):  # the rows that never came
            kv.k[:, 0, a:b].normal_()
            kv.v[:, 0, a:b].normal_()
        feats_seen = feats.clone()
        feats_seen[a:b] = torch.randn(b - a, cfg.width)
        h = model.block(F.embedding(ids, embed),
                        block_step(pos, 4, torch.device("cpu"), known), eager)
        want = h[1:] @ head.T
        k, v, logits, top = draft_step(
            feats_seen, torch.tensor([done]), torch.tensor([pos]), known, ids,
            cache.k[:, 0, :32], cache.v[:, 0, :32], embed, model.fc.weight,
            model.hidden_norm.weight, model.kv_weights(), [layer_weights(x) for x in model.layers],
            model.inv_freq, model.norm.weight, head, m.rms_norm_eps, m.num_heads, m.num_kv_heads,
            m.head_dim, 1.0, 3)
    assert torch.allclose(logits, want, atol=1e-4), (logits - want).abs().max()
    assert torch.equal(top, logits.topk(3, dim=-1).indices)
    new = [p - done for p in range(done, pos) if not a <= p < b]  # (rows of the hole: junk)
    assert torch.allclose(k[:, new], eager.k[:, 0, [done + i for i in new]], atol=1e-5)
    assert torch.allclose(v[:, new], eager.v[:, 0, [done + i for i in new]], atol=1e-5)
    # the mask is what hid the junk: the whole context's block is another
    assert torch.allclose(whole, h, atol=1e-5) == (hole is None)


def test_batched_proposals_equal_each_alone(any_draft, tiny_llama):
    """Several contexts' proposals in one step (`propose_batch`, `draft_step_batch`: what the
    draft process runs for the verdicts of one batched verify step on a GPU) against each
    context's proposal alone: the logits within float32 rounding, the same chains and trees,
    the same draft KV rows, across rounds with kept tree rows; a padded batch of 3; with
    sliding-window layers too."""
    from layersplit.shards.fused import fuse_projections

    draft_dir = any_draft
    cfg = read_dflash_config(draft_dir)
    shape = ((0,), (1,), (0, 0), (0, 1), (2,), (0, 0, 0))
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(320, 64, generator=g)
    head = torch.randn(320, 64, generator=g)
    props = []
    for _ in range(2):
        model = load_dflash(draft_dir, cfg, torch.float32, "cpu")
        fuse_projections(model, compile=False)
        p = DFlashProposer(model, embed, head, 64, torch.device("cpu"), graphs=True, bucket=16)
        p.cfg = dataclasses.replace(cfg, spec_tree=shape)
        p.set_slots(4)
        props.append(p)
    solo, batched = props
    assert not batched.batches(3)  # (on the CPU the draft process proposes one by one)
    feats = torch.randn(4, 60, cfg.width, generator=g)
    for p in props:
        for slot in range(4):
            p.begin(slot)
            p.write_features(slot, 0, 0, feats[slot])
    slots, pos = [3, 0, 2], {3: 9, 0: 20, 2: 14}
    kept: dict[int, list[int] | None] = dict.fromkeys(slots)
    for rnd in range(3):
        reqs = [(s, 5 + s + rnd, pos[s], 3, (0, 4, 6)[i], kept[s]) for i, s in enumerate(slots)]
        want = [solo.propose(s, t, p_, n, None, 0, tree, k) for s, t, p_, n, tree, k in reqs]
        assert batched.propose_batch(reqs) == want, rnd
        for s in slots:
            rows = slice(0, pos[s] + 4)
            assert torch.allclose(batched.kv.k[:, s, rows], solo.kv.k[:, s, rows], atol=1e-5)
            assert batched.done[s] == solo.done[s] == pos[s]
        want_logits = [solo.logits(s, t, p_, n) for s, t, p_, n, _, _ in reqs]
        with torch.inference_mode():
            got_logits, _ = batched._static_scores_batch([(s, t, p_) for s, t, p_, *_ in reqs])
        for a, b in zip(got_logits, want_logits):
            assert torch.allclose(a, b, atol=1e-4), (rnd, (a - b).abs().max())
        for i, s in enumerate(slots):  # the next step: a tree keeps a path, a chain moves on
            kept[s] = [1, 3] if (0, 4, 6)[i] else None
            pos[s] += 3
    with pytest.raises(ValueError, match="outside"):
        batched.propose_batch([(1, 5, 10, 3, 0, None), (2, 5, 70, 3, 0, None)])


def test_a_context_with_a_gap_reads_every_row_but_the_gap(any_draft):
    """After `gap(slot, a, b)` (the target sent no rows for a stretch of plain steps,
    `runtime.speculative.DraftClient.taps`) every path of a proposal (eager, the captured
    step, batched) reads every context row but [a, b): other junk there in each proposer
    changes no proposal, and the paths agree; a context without the gap reads it; a new
    sequence in the slot reads every row again."""
    from layersplit.shards.fused import fuse_projections

    cfg = read_dflash_config(any_draft)
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(320, 64, generator=g), torch.randn(320, 64, generator=g)
    feats = torch.randn(3, 60, cfg.width, generator=g)
    props = []
    for graphs in (False, True, True):
        model = load_dflash(any_draft, cfg, torch.float32, "cpu")
        fuse_projections(model, compile=False)
        p = DFlashProposer(model, embed, head, 64, torch.device("cpu"), graphs=graphs, bucket=16)
        p.set_slots(3)
        props.append(p)
    eager, solo, batched = props
    gaps, pos = {0: (6, 14), 2: (20, 30)}, {0: 20, 2: 37}
    for p in props:
        for slot in (0, 2):
            a, b = gaps[slot]
            p.begin(slot)
            p.write_features(slot, 0, 0, feats[slot])
            p.logits(slot, 5, 4, 3)  # (rows projected before the gap)
            p.write_features(slot, 0, a, torch.randn(b - a, cfg.width, generator=g))  # (junk)
            p.gap(slot, a, b)
    for rnd in range(2):
        reqs = [(s, 7 + s + rnd, pos[s], 3, 0, None) for s in (0, 2)]
        want = [eager.propose(s, t, p_, n, None, 0, tree, k) for s, t, p_, n, tree, k in reqs]
        assert [solo.propose(s, t, p_, n, None, 0, tree, k)
                for s, t, p_, n, tree, k in reqs] == want, rnd
        assert batched.propose_batch(reqs) == want, rnd
        for s, t, p_, n, _, _ in reqs:
            assert torch.allclose(solo.logits(s, t, p_, n), eager.logits(s, t, p_, n),
                                  atol=1e-4)
            pos[s] += 3
    whole = DFlashProposer(eager.draft, embed, head, 64, torch.device("cpu"), graphs=False)
    whole.set_slots(3)
    whole.begin(2)
    whole.write_features(2, 0, 0, feats[2])
    assert not torch.allclose(whole.logits(2, 7, pos[2], 3), eager.logits(2, 7, pos[2], 3),
                              atol=1e-3)
    eager.begin(2)  # (a new sequence: no gap)
    eager.write_features(2, 0, 0, feats[2])
    assert torch.allclose(whole.logits(2, 7, pos[2], 3), eager.logits(2, 7, pos[2], 3),
                          atol=1e-5)
    for slot, a, b in ((3, 1, 5), (0, 5, 5), (0, -1, 5), (0, 5, 65)):
        with pytest.raises(ValueError, match="gap"):
            eager.gap(slot, a, b)


def test_a_failed_batched_proposal_leaves_each_context_as_it_was(draft_dir, monkeypatch):
    """A batched step that fails (a capture out of memory, say) advances no context: the
    proposals the draft process then computes one by one (`draft.server._prepare`'s fallback)
    write the context rows the failed step did not, and equal a proposer's that never failed."""
    from layersplit.shards.fused import fuse_projections

    cfg = read_dflash_config(draft_dir)
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(320, 64, generator=g), torch.randn(320, 64, generator=g)
    props = []
    for _ in range(2):
        model = load_dflash(draft_dir, cfg, torch.float32, "cpu")
        fuse_projections(model, compile=False)
        p = DFlashProposer(model, embed, head, 64, torch.device("cpu"), graphs=True, bucket=16)
        p.set_slots(3)
        props.append(p)
    solo, failing = props
    feats = torch.randn(3, 60, cfg.width, generator=g)
    for p in props:
        for slot in range(3):
            p.begin(slot)
            p.write_features(slot, 0, 0, feats[slot])
            p.propose(slot, 4, 6 + slot, 3)  # each context holds rows up to its position
    reqs = [(0, 9, 9, 3, 0, None), (2, 7, 11, 3, 0, None)]

    def boom(*args):
        raise torch.cuda.OutOfMemoryError("out of memory (test)")

    with monkeypatch.context() as m:
        m.setattr(failing, "_graph_step_batch", boom)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            failing.propose_batch(reqs)
    assert failing.done == solo.done
    for r in reqs:
        assert failing.propose(*r[:4]) == solo.propose(*r[:4])
    for slot in (0, 2):
        assert torch.equal(failing.kv.k[:, slot, :12], solo.kv.k[:, slot, :12])


def test_windowed_layers_see_what_z_lab_s_mask_lets_them():
    """`block_mask`: a sliding layer's block row at position q sees keys q - window < k <= q
    (causal), a full one every key; `is_causal` makes a full layer's block causal."""
    from layersplit.draft.dflash import block_mask
    from layersplit.draft.dflash_config import read_dflash_config_dict

    q, k = torch.arange(10, 13), torch.arange(0, 13)
    m = block_mask((4, True), q, k)
    assert m[0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert m[2].nonzero().flatten().tolist() == [9, 10, 11, 12]
    assert block_mask((None, False), q, k).all()
    raw = {**json.loads((PRESET / "config.json").read_text()),
           "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048}
    cfg = read_dflash_config_dict(raw, PRESET / "config.json")
    assert [cfg.attention(i) for i in (0, 4)] == [(2048, True), (None, False)]
    cfg = read_dflash_config_dict({**raw, "is_causal": False}, PRESET / "config.json")
    assert cfg.attention(0) == (2048, False)
    with pytest.raises(CheckpointError, match="sliding_window"):
        read_dflash_config_dict({**raw, "sliding_window": None}, PRESET / "config.json")


def test_the_window_changes_the_proposal(any_draft, draft_dir, tiny_llama):
    """(So that the tests above can fail: the windowed draft's logits differ from the full
    one's of the same weights.)"""
    if any_draft == draft_dir:
        return
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(320, 64, generator=g), torch.randn(320, 64, generator=g)
    outs = []
    for d in (draft_dir, any_draft):
        cfg = read_dflash_config(d)
        p = DFlashProposer(load_dflash(d, cfg, torch.float32, "cpu"), embed, head, 64,
                           torch.device("cpu"), graphs=False)
        p.write_features(0, 0, 0, torch.randn(40, cfg.width, generator=torch.Generator()
                                              .manual_seed(2)))
        outs.append(p.logits(0, 7, 30, 3))
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)
