"""Hybrid models (Qwen3.5 text, Qwen3.5-MoE text, Qwen3-Next) equal transformers' own, whole and
range by range, from their HF folders and from GGUF files converted as llama.cpp converts them;
each range reads only its tensors; bad configs and files are refused by name."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from layersplit.shards import graphs as graph_module
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor

from tests.helpers import cpu_capture, token_ids

transformers = pytest.importorskip("transformers")
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
L, F = "linear_attention", "full_attention"



@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hybrid_models, family):
    """Prefill chunks longer than one delta-rule chunk (64), then decode steps."""
    path = hybrid_models[family]
    ckpt = open_checkpoint(path)
    assert ckpt.config.hybrid is not None
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=256)
    ids = token_ids(155)
    ours = [ex.run(ids[a:b], a, all_logits=True) for a, b in ((0, 80), (80, 150))]
    ours += [ex.run(ids[t:t + 1], t) for t in range(150, 155)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = torch.cat(ours)
    assert ours.shape == ref.shape
    # 1e-5 per unit of the logits' magnitude (~2.5 here): float32 rounding over 155 tokens of
    # recurrent state and routed experts reaches 1.4e-5 (6.5e-6 with transformers' own chunks)
    assert (ours - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [(0, 2, 4, 6), (0, 1, 6), (0, 3, 6)])
def test_range_by_range_equals_whole(hybrid_models, family, split):
    ckpt = open_checkpoint(hybrid_models[family])
    whole = RangeExecutor(load_layer_range(ckpt, 0, 6), max_len=128)
    parts = [RangeExecutor(load_layer_range(ckpt, a, b), max_len=128)
             for a, b in zip(split[:-1], split[1:])]
    ids = token_ids(92, seed=2)
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


@pytest.mark.parametrize("change", [{"norm_topk_prob": False}, {"mlp_only_layers": [1]},
                                    {"decoder_sparse_step": 2}], ids=lambda c: next(iter(c)))
def test_qwen3_5_moe_refuses_qwen3_next_routing_fields(hybrid_models, tmp_path, change):
    """transformers' Qwen3.5-MoE has no such field (every layer sparse, top k renormalised)."""
    bad = _edit(hybrid_models["qwen3_5_moe"], tmp_path / "bad", **change)
    with pytest.raises(CheckpointError, match=f"field '{next(iter(change))}' of "
                                              "qwen3_5_moe_text is not supported"):
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


@pytest.fixture(scope="module")
def hybrid_ggufs(hybrid_models, tmp_path_factory):
    """family -> (HF folder, the GGUF llama.cpp's converter would make of it). Qwen3-Next's
    GGUF layout holds a full_attention_interval and experts in every layer: its folder here has
    those."""
    from layersplit.shards.tiny import write_tiny_hybrid, write_tiny_hybrid_gguf

    root = tmp_path_factory.mktemp("hybrid-gguf")
    folders = {**hybrid_models, "qwen3_next": write_tiny_hybrid(
        root / "next", "qwen3_next", layer_types=[L, F] * 3, mlp_only_layers=[])}
    return {fam: (folders[fam], write_tiny_hybrid_gguf(folders[fam], root / f"{fam}.gguf"))
            for fam in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_equals_hf_folder(hybrid_ggufs, family):
    """Two ranges read from the GGUF file give the HF folder's logits (prefill then decode);
    llama.cpp's changes (norms + 1, -exp(A_log), tiled value heads, split in_proj_qkvz,
    stacked experts) are undone."""
    folder, path = hybrid_ggufs[family]
    hf_cfg, gg_cfg = open_checkpoint(folder).config, open_checkpoint(path).config
    assert gg_cfg.model_type == hf_cfg.model_type
    assert gg_cfg.hybrid.layer_types == hf_cfg.hybrid.layer_types
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "dense_layers"):
        assert getattr(gg_cfg, field) == getattr(hf_cfg, field), field
    whole = RangeExecutor(load_layer_range(open_checkpoint(folder), 0, 6), max_len=128)
    parts = [RangeExecutor(load_layer_range(open_checkpoint(path), a, b), max_len=128)
             for a, b in ((0, 2), (2, 6))]
    assert all(n.startswith(("layers.0.", "layers.1.", "layers.2.", "layers.3.", "norm.",
                             "lm_head."))
               for n, _ in parts[1].model.named_parameters())
    ids = token_ids(90, seed=3)
    for a, b in ((0, 70), (70, 89), (89, 90)):
        x = ids[a:b]
        for p in parts:
            x = p.run(x, a, all_logits=True)
        want = whole.run(ids[a:b], a, all_logits=True)
        assert (x - want).abs().max().item() < 1e-5


def _gguf_edit(src, dst, edit):
    from layersplit.shards.tiny import write_tiny_hybrid_gguf

    return write_tiny_hybrid_gguf(src, dst, edit=edit)


@pytest.mark.parametrize("edit, words", [
    (lambda w: w.add_bool("qwen35.ssm.dt_b_c_rms", True), "'qwen35.ssm.dt_b_c_rms'"),
    (lambda w: w.add_tensor("blk.0.ssm_d", np.ones(4, np.float32)), "'blk.0.ssm_d'"),
    (lambda w: w.add_full_attention_interval(2), "full_attention_interval=2 disagrees"),
    (lambda w: w.add_string("qwen35.rope.scaling.type", "yarn"), "rope.scaling.type='yarn'"),
    (lambda w: w.add_uint32("qwen35.rope.dimension_count", 3), "rope.dimension_count=3"),
], ids=["key", "tensor", "interval", "rope-scaling", "odd-rotary"])
def test_gguf_fields_and_tensors_not_read_are_refused(hybrid_ggufs, tmp_path, edit, words):
    bad = _gguf_edit(hybrid_ggufs["qwen3_5"][0], tmp_path / "bad.gguf", edit)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        open_checkpoint(bad)


def test_gguf_of_an_unknown_hybrid_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "kimi.gguf"
    w = gguf.GGUFWriter(str(path), "kimi-linear")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="'kimi-linear' is not supported.*qwen35"):
        open_checkpoint(path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("paged", [False, True])
def test_static_decode_steps_equal_eager(hybrid_models, family, paged):
    """The captured decode step of a hybrid range (run uncaptured on CPU: static buffers, the
    position on the device, bucketed masked attention, the slot's states advanced in place)
    gives the eager step's logits, two sequences in their own slots interleaved, across bucket
    boundaries; the states it leaves equal the eager path's, and a verify step after it (row
    by row, eager) still agrees."""
    ckpt = open_checkpoint(hybrid_models[family])
    extra = {"paged": (64, 8)} if paged else {}
    eager = RangeExecutor(load_layer_range(ckpt, 0, 6), 160, 2, static_decode=False, **extra)
    static = RangeExecutor(load_layer_range(ckpt, 0, 6), 160, 2, static_decode=True,
                           graph_bucket=4, **extra)  # hybrid buckets: 4 x 4 keys
    if paged:  # slot 0 takes the even blocks, slot 1 the odd ones, in reverse
        for ex in (eager, static):
            ex.kv.set_table(0, 0, list(range(0, 40, 2)))
            ex.kv.set_table(1, 0, list(range(39, 0, -2)))
    steps = []  # the static steps taken: every decode step below must be one
    inner = static.static._step
    static.static._step = lambda *a: steps.append(a) or inner(*a)
    prompts = [token_ids(21, seed=6), token_ids(9, seed=7)]
    tok = [[0, 0], [0, 0]]  # [executor][slot]: the last token
    for slot, ids in enumerate(prompts):
        for i, ex in enumerate((eager, static)):
            tok[i][slot] = int(ex.run(ids, 0, slot).argmax())
    pos = [21, 9]
    for _ in range(30):  # crosses bucket boundaries of both slots
        for slot in (0, 1):
            a = eager.run(torch.tensor([tok[0][slot]]), pos[slot], slot)
            b = static.run(torch.tensor([tok[1][slot]]), pos[slot], slot)
            assert (a - b).abs().max().item() < 5e-5
            tok[0][slot], tok[1][slot] = int(a.argmax()), int(b.argmax())
            assert tok[0][slot] == tok[1][slot]
            pos[slot] += 1
    assert len(steps) == 60 and {a[0] for a in steps} == {0, 1}  # (slot, kv_len, rows)
    # hybrid buckets are HYBRID_BUCKET_FACTOR (4) x 4 keys wide
    assert {a[1] for a in steps} == {16, 32, 48, 64}
    assert torch.allclose(eager.kv.state, static.kv.state, atol=1e-5)
    assert torch.allclose(eager.kv.conv, static.kv.conv, atol=1e-5)
    rows = torch.tensor([tok[0][0], 3, 5])
    a, b = (ex.run(rows, pos[0], 0, all_logits=True, verify=True) for ex in (eager, static))
    assert (a - b).abs().max().item() < 5e-5


def test_a_capture_leaves_the_slot_state_as_it_was(hybrid_models, monkeypatch):
    """A CUDA capture runs the step twice before recording it (warm-up), and a hybrid step
    advances its slot's states in place: the decoder must put them back, or every new graph
    (each KV bucket, each slot) would skip the state ahead. Here the capture is a CPU stand-in
    that runs the step as the real one does (two warm-ups, the recorded call; a replay runs it
    once more into the same outputs); the tokens and states must still be the eager path's."""
    import layersplit.shards.graphs as graphs

    class Replay:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            new, taps = self.fn()
            self.out[0].copy_(new)

    def cpu_capture(fn, pool):
        fn()
        fn()
        out = fn()  # (a real capture records this call without running it: it runs here)
        return Replay(fn, out), out

    monkeypatch.setattr(graphs, "capture", cpu_capture)
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    eager = RangeExecutor(load_layer_range(ckpt, 0, 6), 128, 1, static_decode=False)
    static = RangeExecutor(load_layer_range(ckpt, 0, 6), 128, 1, static_decode=True,
                           graph_bucket=4)  # hybrid buckets: 4 x 4 keys
    static.static.capture = True
    ids = token_ids(13, seed=8)
    tok = [int(ex.run(ids, 0).argmax()) for ex in (eager, static)]
    for pos in range(13, 40):  # new graphs at 16, 32 and 48 keys
        a, b = eager.run(torch.tensor([tok[0]]), pos), static.run(torch.tensor([tok[1]]), pos)
        assert (a - b).abs().max().item() < 5e-5, pos
        tok = [int(a.argmax()), int(b.argmax())]
    assert len(static.static.graphs) == 3
    assert torch.allclose(eager.kv.state, static.kv.state, atol=1e-5)


def test_a_failed_capture_leaves_the_slot_state_as_it_was(hybrid_models, monkeypatch):
    """A capture that fails after its warm-up runs (out of memory, an invalidated capture) must
    not leave the slot's states advanced: the step fails, the sequence's state stays whole."""
    import layersplit.shards.graphs as graphs

    def failing_capture(fn, pool):
        fn()
        fn()
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "capture", failing_capture)
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    static = RangeExecutor(load_layer_range(ckpt, 0, 6), 128, 1, static_decode=True,
                           graph_bucket=4)  # hybrid buckets: 4 x 4 keys
    static.static.capture = True
    static.run(token_ids(13, seed=8), 0)
    conv, state = static.kv.save(0)
    with pytest.raises(RuntimeError, match="capture failed"):
        static.run(torch.tensor([5]), 13)
    assert torch.equal(static.kv.conv[:, 0], conv) and torch.equal(static.kv.state[:, 0], state)


@pytest.mark.parametrize("family,paged,fused,graphs", [
    ("qwen3_5", False, False, "eager"), ("qwen3_5", True, False, "eager"),
    ("qwen3_next", True, False, "eager"), ("qwen3_5", True, True, "eager"),
    ("qwen3_next", False, True, "eager"), ("qwen3_5", True, False, "static"),
    ("qwen3_next", False, True, "static"), ("qwen3_5", True, False, "captured")])
def test_chain_verify_in_one_step_equals_row_by_row(hybrid_models, family, paged, fused,
                                                    graphs, monkeypatch):
    """A hybrid range's chain verify step as one step of all its rows (the GPU's path:
    `_hybrid_chain`; `static`: the verify graph's step, run uncaptured on the CPU: positions on
    the device, the shared keep buffers; `captured`: through a CPU stand-in for the capture, the
    one graph of a paged cache serving both slots) gives the row-by-row step's logits and
    tapped rows, leaves the slot's states as they were, and for every number of accepted rows
    the next step (settled on that row's kept states) gives the row-by-row executor's logits.
    Two slots verify before either settles (the second verify must not overwrite the first's
    kept rows). `fused`: the GPU's fused weights and one-token step (`shards.fused_hybrid`,
    uncompiled here)."""
    from layersplit.shards.fused import fuse_projections

    ckpt = open_checkpoint(hybrid_models[family])
    extra = {"paged": (64, 8)} if paged else {}
    taps = (1, 4)
    models = [load_layer_range(ckpt, 0, 6) for _ in range(2)]
    if fused:
        for m in models:
            fuse_projections(m, compile=False)
        assert all(layer.fast is not None for layer in models[1].layers)
    one, rows = (RangeExecutor(m, 96, 2, static_decode=st, graph_bucket=4, taps=taps, **extra)
                 for m, st in zip(models, (graphs != "eager", False)))
    if graphs == "captured":
        monkeypatch.setattr(graph_module, "capture", cpu_capture)
        one.static.capture = True
    one.hybrid_chain_verify = True
    assert not rows.hybrid_chain_verify  # (the CPU's default: bit for bit a decode step)
    if paged:
        for ex in (one, rows):
            ex.kv.set_table(0, 0, list(range(0, 24, 2)))
            ex.kv.set_table(1, 0, list(range(23, 0, -2)))
    calls = []  # the verify steps' slots, as the one-step path took them
    if graphs == "static":
        inner_step = one.static._step
        one.static._step = lambda *a: (a[2] > 1 and calls.append(a[0])) or inner_step(*a)
    else:
        inner = one._hybrid_chain
        one._hybrid_chain = lambda *a: calls.append(a[2]) or inner(*a)  # (x, pos, slot, ...)
    prompts = {0: token_ids(13, seed=8), 1: token_ids(7, seed=9)}
    for ex in (one, rows):
        for slot, ids in prompts.items():
            ex.run(ids, 0, slot)
    rows_of = torch.tensor([5, 17, 3, 9, 11, 2])
    # (chains of 5, then 3 rows (views of the keep buffers), then 6 (new buffers), then 5)
    for accepts, m in [((0, 4), 5), ((2, 1), 3), ((3, 5), 6), ((4, 0), 5)]:
        chain = rows_of[:m]
        verified = {}
        for slot in (0, 1):  # both verify first: slot 1's step must leave slot 0's rows
            pos = len(prompts[slot])
            before = one.kv.save(slot)
            got_taps, want_taps = {}, {}
            a = one.run(chain, pos, slot, all_logits=True, taps=got_taps, verify=True).clone()
            b = rows.run(chain, pos, slot, all_logits=True, taps=want_taps, verify=True)
            assert a.shape == b.shape == (m, ckpt.config.vocab_size)
            assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
            assert got_taps.keys() == want_taps.keys() == set(taps)
            for t in taps:
                assert (got_taps[t] - want_taps[t]).abs().max().item() < 1e-5
            assert all(torch.equal(x, y) for x, y in zip(one.kv.save(slot), before))
            verified[slot] = b
        for slot, accepted in zip((0, 1), accepts):
            # the next step after `accepted` draft rows kept (their logits picked the token)
            nxt = len(prompts[slot]) + accepted + 1
            follow = torch.tensor([int(verified[slot][accepted].argmax())])
            for ex in (one, rows):
                ex.before_step(slot, nxt, None)
            a, b = (ex.run(follow, nxt, slot) for ex in (one, rows))
            assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
            for x, y in zip(one.kv.save(slot), rows.kv.save(slot)):
                assert (x.float() - y.float()).abs().max().item() < 1e-5
            prompts[slot] = torch.cat([prompts[slot], chain[:accepted + 1], follow])
    if graphs == "captured":  # (every verify step replayed a graph of any slot)
        assert calls == [] and {k[0] for k in one.static.verify_graphs} == {-1}
    else:
        assert calls == [0, 1] * 4  # (every verify step above took the one-step path)


def test_a_failed_verify_graph_leaves_chain_verify_steps_eager(hybrid_models, caplog):
    """A hybrid verify graph that fails (its capture or replay) is logged; that step and every
    chain verify step after it run the eager one-step path, with its logits and kept states."""
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    one, rows = (RangeExecutor(load_layer_range(ckpt, 0, 6), 96, 1, static_decode=st,
                               graph_bucket=4) for st in (True, False))
    one.hybrid_chain_verify = True
    inner = one.static.run

    def failing(x, *a):
        if x.shape[0] > 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return inner(x, *a)
    one.static.run = failing
    ids = token_ids(11, seed=3)
    for ex in (one, rows):
        ex.run(ids, 0, 0)
    chain = torch.tensor([4, 8, 15, 16])
    pos = 11
    for accepted in (2, 0):
        with caplog.at_level("WARNING", logger="layersplit.shards.executor"):
            a, b = (ex.run(chain, pos, 0, all_logits=True, verify=True) for ex in (one, rows))
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
        nxt = pos + accepted + 1
        for ex in (one, rows):
            ex.before_step(0, nxt, None)
        a, b = (ex.run(torch.tensor([7]), nxt, 0) for ex in (one, rows))
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
        pos = nxt + 1
    assert not one.hybrid_verify_graphs
    assert caplog.text.count("a hybrid verify graph failed (RuntimeError: operation not "
                             "permitted") == 1


@pytest.mark.parametrize("family,paged,fused,captured", [
    ("qwen3_5", True, False, False), ("qwen3_5", False, False, False),
    ("qwen3_next", True, False, False), ("qwen3_5_moe", True, False, False),
    ("qwen3_5", True, True, False), ("qwen3_5_moe", False, True, False),
    ("qwen3_5", True, False, True), ("qwen3_5", False, False, True)])
def test_batched_decode_steps_equal_each_sequence_alone(hybrid_models, family, paged, fused,
                                                        captured, monkeypatch):
    """A hybrid range's batched decode step (`StaticDecoder.run_batch`, uncaptured on the CPU,
    or with `captured` through a CPU stand-in for the capture: its warm-up runs on the scratch
    slot, then a replay with each row's slot, and a new capture once a sequence crosses 16 keys;
    each row's state slot an input, padded to 4 rows) gives each sequence's own decode step's
    logits and tapped rows and leaves each slot's states as those steps do; the idle slot 1 (a
    padding row of the contiguous cache's window) and its states are left as they were.
    `fused`: the GPU's fused step (`shards.fused_hybrid`, uncompiled) takes the batched rows,
    against the unfused range's steps one sequence at a time."""
    from layersplit.shards.fused import fuse_projections

    ckpt = open_checkpoint(hybrid_models[family])
    extra = {"paged": (96, 8)} if paged else {}
    models = [load_layer_range(ckpt, 0, 6) for _ in range(2)]
    if fused:
        fuse_projections(models[0], compile=False)
        calls = []
        fast = models[0].layers[0].fast
        inner = fast._run
        fast._run = lambda *a, **kw: calls.append(a[-1].lo is not None) or inner(*a, **kw)
    bat, one = (RangeExecutor(m, 96, 4, static_decode=st, graph_bucket=4, taps=(2,), **extra)
                for m, st in zip(models, (True, False)))
    if captured:
        monkeypatch.setattr(graph_module, "capture", cpu_capture)
        bat.static.capture = True
    if paged:
        for ex in (bat, one):
            for slot in range(4):
                ex.kv.set_table(slot, 0, list(range(slot, 48, 4)))
    prompts = {s: token_ids(n, seed=s + 1) for s, n in enumerate((9, 5, 14, 3))}
    last = {}
    for ex in (bat, one):
        for slot, ids in prompts.items():
            last[slot] = int(ex.run(ids, 0, slot).argmax())
    idle = bat.kv.save(1)
    live = [3, 0, 2]  # (rows in this order, any slots)
    pos = {s: len(prompts[s]) for s in live}
    for _ in range(6):
        x = torch.tensor([last[s] for s in live])
        taps = {}
        got = bat.static.run_batch(x, live, [pos[s] for s in live], taps)
        for i, s in enumerate(live):
            want_taps = {}
            want = one.run(x[i:i + 1], pos[s], s, taps=want_taps)
            assert (got[i] - want[0]).abs().max().item() < 1e-4 * want.abs().max().item()
            assert (taps[2][i] - want_taps[2][0]).abs().max().item() < 1e-5
            last[s] = int(want.argmax())
            pos[s] += 1
    for s in live:
        for x, y in zip(bat.kv.save(s), one.kv.save(s)):
            assert (x.float() - y.float()).abs().max().item() < 1e-5
    assert all(torch.equal(x, y) for x, y in zip(bat.kv.save(1), idle))
    if fused:  # (every layer's batched step took the fused path: 6 layers x 6 steps)
        assert calls.count(True) == 36
    if captured:  # (slot 2 crossed 16 keys: a second graph, captured while slots held rows)
        assert len(bat.static.batch_graphs) >= 2
