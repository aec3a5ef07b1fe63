"""The Triton decode kernels (`shards.kernels`) against the torch decode path they replace.

On a CUDA device (`python -m pytest -m gpu`). On a CPU, the same tests run through Triton's
interpreter with `TRITON_INTERPRET=1` (float32 only: the interpreter's bf16 matmul is wrong).

Tolerances: float32 outputs within 1e-4 (relative norm) of the torch path; bf16 within 2e-2
(bf16 rounds at 4e-3 per operation, and the two paths round at different points); V rows the
kernel writes equal the torch path's, K rows within a few bf16 ulps (4e-2 absolute).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections, pre_attention, rms_norm
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.kv_cache import KVCache, KVLayout
from layersplit.shards.layers.attention import Attention
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.spec_tree import ancestors, depths
from layersplit.shards.tiny import FAMILY_CONFIGS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])

if INTERPRET:  # Triton 3.6's interpreter takes int() of 1-element arrays, which NumPy 2.4 refuses
    from triton.runtime import interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch


def _attention(family: str, heads: int, kv_heads: int, head_dim: int, window: int | None,
               dtype: torch.dtype) -> Attention:
    raw = {**FAMILY_CONFIGS[family], "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 64,
           "max_position_embeddings": 4096}
    if window is not None:
        if family == "llama":  # Mistral: every layer windowed
            raw.update(model_type="mistral", architectures=["MistralForCausalLM"],
                       sliding_window=window)
            raw.pop("attention_bias", None)
        else:  # Qwen2/Qwen3: layers >= max_window_layers windowed
            raw.update(sliding_window=window, use_sliding_window=True, max_window_layers=0)
    a = Attention(config_from_hf(raw, "test"), 0)
    assert a.window == window
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.3))
        if a.q_norm is not None:
            a.q_norm.weight.copy_(1 + 0.2 * torch.randn_like(a.q_norm.weight))
            a.k_norm.weight.copy_(1 + 0.2 * torch.randn_like(a.k_norm.weight))
    a.fuse()
    return a.to(DEV, dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _random_tree(n: int) -> list[int]:
    """The parents of rows 1..n-1 of a random preorder tree (`shards.spec_tree`)."""
    parents, path = [], [0]
    for j in range(1, n):
        p = path[int(torch.randint(0, len(path), ()))]
        parents.append(p)
        del path[path.index(p) + 1:]
        path.append(j)
    return parents


def _poison(kv: KVCache, slot: int, rows: torch.Tensor) -> None:
    """Stale values in the rows the step writes: a kernel that reads them before its own write
    lands is far off (a large key dominates its softmax)."""
    for r in rows.tolist():
        if r < kv.max_len:
            kv.k_store[0, slot, r] = 40.0
            kv.v_store[0, slot, r] = 1e3


CASES = [  # family, heads, kv heads, head dim, window, kind, rows, keys attended, split keys
    ("llama", 9, 3, 64, None, "decode", 1, 256, None),
    ("llama", 9, 3, 64, None, "decode", 1, 768, 256),
    ("qwen3", 8, 2, 128, None, "decode", 1, 512, None),
    ("qwen2", 4, 2, 32, 40, "decode", 1, 256, None),
    ("llama", 4, 2, 16, 24, "tree", 7, 128, 64),
    ("qwen3", 8, 2, 32, None, "tree", 31, 192, None),  # 4 query tiles, each its own program
    ("llama", 9, 3, 64, None, "tree", 31, 600, 128),  # 3 query tiles x 5 key splits
    ("llama", 4, 4, 16, None, "chain", 5, 64, None),
    ("qwen3", 8, 2, 32, None, "batched", 6, 256, None),
    ("qwen2", 4, 2, 32, 30, "batched", 4, 128, 64),
    ("llama", 9, 3, 64, None, "decode", 1, 900, 64),  # 15 splits (float32) or 8 (bf16)
    ("llama", 9, 3, 64, None, "decode", 1, 4500, 128),  # 36: the combine's groups of 32
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_attention_matches_torch_path(case, dtype):
    """One layer's kernel (norms, rotary, KV write, attention) against `pre_attention` +
    `KVCache.append` + `Attention._grouped` (`append_batch` + `_grouped_batch` for batched
    steps) on the same inputs, fresh random ones for each case."""
    _check_against_torch(case, dtype, sinks=False)


SINK_CASES = [CASES[1], CASES[3], CASES[6], CASES[9], CASES[11]]  # split, window, tree, batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_attention_with_sinks_matches_torch_path(case, dtype):
    """gpt-oss's attention sinks (a logit per head in each softmax that takes probability and
    adds no value), in the kernel with and without key splits, against the torch path's
    `sink_softmax`."""
    _check_against_torch(case, dtype, sinks=True)


def _check_against_torch(case: tuple, dtype: torch.dtype, sinks: bool) -> None:
    from layersplit.shards.kernels import decode_attention as da
    from layersplit.shards.kernels.decode_attention import decode_attention

    if INTERPRET and -(-case[7] // case[8]) > da.STATIC_SPLITS:  # (on a GPU it runs)
        pytest.skip("the combine's loop over groups of splits: Triton's interpreter refuses "
                    "its mask's dtype")

    family, h, g, d, window, kind, n, kv_len, split = case
    torch.manual_seed(CASES.index(case))
    a = _attention(family, h, g, d, window, dtype)
    if sinks:  # large enough to take a good share of some rows' softmax (drawn apart: the
        # case's other inputs stay the ones its test without sinks draws)
        gen = torch.Generator(device=DEV).manual_seed(99)
        a.sinks = torch.nn.Parameter(torch.randn(h, device=DEV, generator=gen) * 2 + 1,
                                     requires_grad=False)
    slots, max_len = (8, kv_len + 16)
    kv = KVCache(KVLayout(1, g, d, dtype), max_len, slots, DEV)
    kv.k_store.normal_()
    kv.v_store.normal_()
    x = torch.randn(n, 64, device=DEV, dtype=dtype)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    if kind == "batched":
        positions = torch.randint(0, kv_len, (n,), device=DEV)
        positions[1] = max_len  # a padding row: writes the scratch row only
        step = StepInfo.batched(positions, 2, kv_len)
        rows, slot0, slot = positions, 2, None
    else:
        pos = torch.tensor([kv_len - n - 3], device=DEV)
        if kind == "decode":
            step = StepInfo.static(pos, 1, kv_len)
        else:
            parents = list(range(n - 1)) if kind == "chain" else _random_tree(n)
            step = StepInfo.static_tree(pos, torch.tensor(depths(parents), device=DEV),
                                        ancestors(parents).to(DEV), kv_len)
        rows = step.positions if step.rows is None else step.rows
        slot0 = slot = 3
    freqs = step.positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    mask = step.mask_for(a.window)
    ref_kv = KVCache(KVLayout(1, g, d, dtype), max_len, slots, DEV)
    ref_kv.k_store.copy_(kv.k_store)
    ref_kv.v_store.copy_(kv.v_store)
    eps = 1e-6
    qn = None if a.q_norm is None else a.q_norm.weight
    kn = None if a.k_norm is None else a.k_norm.weight
    with torch.inference_mode():
        q, k, v = pre_attention(x, torch.ones(64, device=DEV, dtype=dtype), a.qkv_proj.weight,
                                a.qkv_proj.bias, qn, kn, cos, sin, eps, h, g, d,
                                kind != "batched")
        x_n = rms_norm(x, torch.ones(64, device=DEV, dtype=dtype), eps)
        # the attention itself in float32 over the torch path's (rounded) q and K/V: the
        # torch path in bf16 rounds its scores to bf16 (an absolute error that grows with the
        # largest score, so with the keys: 3 % at 4,500 keys on an H100), the kernel does not
        if kind == "batched":
            keys, values = ref_kv.append_batch(0, step, k, v)
            want = a._grouped_batch(q.float(), keys.float(), values.float(), mask)
        else:
            keys, values = ref_kv.append(0, slot, step, k, v)
            want = a._grouped(q.float(), keys.float(), values.float(), mask)
        past = []  # (slot, first key) of each sequence: keys from there on are NaN
        for s in range(n if kind == "batched" else 1):
            _poison(kv, slot0 + s, rows[s:s + 1] if kind == "batched" else rows)
            mine = rows[s:s + 1] if kind == "batched" else rows
            past.append((slot0 + s, min(int(mine.max()) + 1, kv_len)))
        for slot_s, first in past:  # keys the step does not see: the kernel must not read
            kv.k_store[0, slot_s, first:kv_len] = float("nan")  # them (a NaN in a masked key
            kv.v_store[0, slot_s, first:kv_len] = float("nan")  # still poisons p @ V)
        qkv = F.linear(x_n, a.qkv_proj.weight, a.qkv_proj.bias)
        got = decode_attention(qkv, cos, sin, kv.k_store[0], kv.v_store[0], rows, slot0, mask,
                               n if kind == "batched" else 1, h, qn, kn, eps, split,
                               sinks=a.sinks, scale=a.scale)
        for slot_s, first in past:
            kv.k_store[0, slot_s, first:kv_len] = ref_kv.k_store[0, slot_s, first:kv_len]
            kv.v_store[0, slot_s, first:kv_len] = ref_kv.v_store[0, slot_s, first:kv_len]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if kind == "batched":  # the padding row's output is garbage in both paths
        live = torch.arange(n, device=DEV) != 1
        got, want = got[live], want[live]
        kv.k_store[0, :, max_len] = ref_kv.k_store[0, :, max_len]
        kv.v_store[0, :, max_len] = ref_kv.v_store[0, :, max_len]
    assert torch.isfinite(got).all()
    assert _rel(got, want) < tol, _rel(got, want)
    assert torch.equal(kv.v_store, ref_kv.v_store)
    # K: the torch path rounds x * cos and rot * sin to bf16 before adding them, the kernel
    # only the sum; a few bf16 ulps of |x| (K values are O(1); a stale or missing row is O(10))
    atol = 1e-5 if dtype == torch.float32 else 4e-2
    k_err = (kv.k_store.float() - ref_kv.k_store.float()).abs()
    assert float(k_err.max()) <= atol, float(k_err.max())


@pytest.mark.parametrize("sinks_shape", [(8,), (4, 2)])
def test_sinks_of_the_wrong_shape_are_refused_by_name(sinks_shape):
    """A sink vector that is not one logit per query head is refused before any launch, and
    the cache is left as it was."""
    from layersplit.shards.kernels.decode_attention import decode_attention

    h, g, d, t = 4, 2, 16, 32
    kv = KVCache(KVLayout(1, g, d, torch.float32), t, 1, DEV)
    before = kv.k_store.clone()
    step = StepInfo.static(torch.tensor([t - 1], device=DEV), 1, t)
    qkv = torch.randn(1, (h + 2 * g) * d, device=DEV)
    cos, sin = torch.ones(1, d, device=DEV), torch.zeros(1, d, device=DEV)
    with pytest.raises(ValueError, match="sinks must be a contiguous"):
        decode_attention(qkv, cos, sin, kv.k_store[0], kv.v_store[0], step.positions, 0,
                         step.mask, 1, h, sinks=torch.zeros(sinks_shape, device=DEV))
    assert torch.equal(kv.k_store, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_counts_past_the_static_ones_combine_in_a_loop(monkeypatch, dtype):
    """More splits than `STATIC_SPLITS` are combined in a loop over groups of that many (one
    compile for every count): the 8- or 15-split case through groups of 2, the last group
    partly empty."""
    from layersplit.shards.kernels import decode_attention as da

    monkeypatch.setattr(da, "STATIC_SPLITS", 2)
    test_decode_attention_matches_torch_path(CASES[-2], dtype)


@pytest.mark.parametrize("keys", [1, 63, 64, 65, 256, 1000, 8192, 65536])
@pytest.mark.parametrize("programs", [1, 3, 8, 48, 500])
def test_key_split_covers_every_key_once(keys, programs):
    from layersplit.shards.kernels.decode_attention import MAX_SPLIT_KEYS, key_split

    for fixed, block in itertools.product((None, 0, 100, 256), (64, 128)):
        splits, per = key_split(keys, programs, torch.device(DEV), fixed, block)
        assert per % block == 0 and splits >= 1
        assert (splits - 1) * per < keys <= splits * per  # no empty split, every key in one
        if fixed == 0:
            assert splits == 1
        if fixed is None:  # however many programs (a batched step), no split is long
            assert per <= max(MAX_SPLIT_KEYS, block)


def _executor(path, family: str, dtype: torch.dtype, kernels: bool | None, slots: int = 1,
              compile: bool = True):
    model = load_layer_range(open_checkpoint(path), 0, 6, dtype, DEV)
    if kernels is not None:
        fuse_projections(model, compile=compile and DEV != "cpu", kernels=kernels)
    return RangeExecutor(model, 256, slots, device=DEV, static_decode=True, graph_bucket=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral-window", "qwen3_moe",
                                    "mixtral"])
def test_kernel_decode_matches_torch_decode(tiny_models, family, dtype):
    """Whole 6-layer models: graph decode steps, a tree verify step and batched steps with the
    kernels against the compiled torch decode step (and the plain CPU path in float32); the
    sparse families' one-row steps through `FusedDecode._moe_row` on a GPU."""
    path = tiny_models[family]
    runs = {"kernels": _executor(path, family, dtype, True, slots=3),
            "torch": _executor(path, family, dtype, False, slots=3)}
    if dtype == torch.float32:
        runs["cpu"] = RangeExecutor(load_layer_range(open_checkpoint(path), 0, 6), 256, 3,
                                    device="cpu")
    else:  # the same weights in float32: how far bf16 itself takes the torch path
        # (uncompiled: its own compiled shapes would crowd dynamo's 8 per function)
        runs["fp32"] = _executor(path, family, torch.float32, False, slots=3, compile=False)
    # per unit of the logits' largest magnitude (`tests.gpu.near`): in bf16 a 6-layer model's
    # logits (up to ~10) differ by a few bf16 steps between two summation orders (2-6 %
    # measured on an H100 and an H200 with paged KV), and near-ties move single steps further;
    # so in bf16 the kernels' worst step may be as far from the float32 run as twice the torch
    # path's worst step, at least 0.05 (the two bf16 paths, prefill included, round at
    # different points). float32 stays within 1e-4 of the torch path at every step, which
    # catches a wrong row or block.
    tol = 1e-4 if dtype == torch.float32 else 0.05
    ids = torch.arange(3, 40)
    for ex in runs.values():
        for slot in range(3):
            ex.run(ids[:30 + slot], 0, slot)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.float().cpu(), b.float().cpu()
        return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))

    drift: dict[str, list[float]] = {"kernels": [], "torch": []}  # bf16: from float32, per step

    def same(outs: dict[str, torch.Tensor]) -> None:
        if "fp32" in outs:  # (bf16) compared over the whole run, below
            for name in drift:
                drift[name].append(rel(outs[name], outs["fp32"]))
            return
        for name, o in outs.items():
            err = rel(o, outs["torch"])
            assert err < tol, (name, err, tol)

    assert runs["kernels"].model.layers[0].fast.kernels  # the kernels ran (no fallback)
    pos, tok = 30, 5
    for _ in range(12 if DEV == "cpu" else 40):  # decode, crossing KV buckets 32 and 64
        outs = {k: ex.run(torch.tensor([tok]), pos) for k, ex in runs.items()}
        same(outs)
        tok, pos = int(outs["torch"].argmax()), pos + 1
    static = {k: ex.static for k, ex in runs.items() if k != "cpu"}  # graph steps on each
    parents = [0, 0, 1, 1, 2, 3]  # a tree verify step of 7 rows
    same({k: st.run(torch.tensor([tok, 7, 9, 11, 4, 6, 8]), pos, 0, parents)[0].clone()
          for k, st in static.items()})
    # a batched step over the other two slots, a padding row between them
    same({k: st.run_batch(torch.tensor([6, 7]), [0, 2], [pos + 7, 32]).clone()
          for k, st in static.items()})
    if drift["torch"]:  # the kernels' worst step as close to float32 as the torch path's
        worst = {name: max(errs) for name, errs in drift.items()}
        assert worst["kernels"] < max(tol, 2 * worst["torch"]), worst
    kv, ref = runs["kernels"].kv, runs["torch"].kv  # the caches hold the same rows
    kv_tol = 1e-3 if dtype == torch.float32 else 0.1
    for name in ("k", "v"):
        got, want = getattr(kv, name).float(), getattr(ref, name).float()
        bound = kv_tol
        if "fp32" in runs:  # bf16: rows of later steps carry the paths' own drift
            bound = max(kv_tol, 2 * float((want - getattr(runs["fp32"].kv, name)).abs().max()))
        assert float((got - want).abs().max()) <= bound, (name, bound)
    fast = runs["kernels"].model.layers[0].fast
    assert fast.kernels and fast.gemv  # (no fallback in any of those steps)
    sparse = [la for la in runs["kernels"].model.layers if hasattr(la.mlp, "experts")]
    if sparse and DEV != "cpu":  # (their one-row steps took `_moe_row`: it takes such a row)
        row = torch.zeros(1, sparse[0].self_attn.o_proj.out_features, device=DEV, dtype=dtype)
        assert fast._moe_row_takes(sparse[0], row)


def _step_with_broken_kernels(path, family: str, monkeypatch, broken: list) -> object:
    """A one-row step of `family` on the kernels, its stages flagged compiled, with the
    `broken` (module, name) functions raising: its logits equal the torch path's; the
    `FusedDecode` of the kernels' run is returned for the caller's checks of what it turned
    off."""
    runs = {k: _executor(path, family, torch.float32, on, compile=False)
            for k, on in (("kernels", True), ("torch", False))}
    ids = torch.arange(3, 30)
    for ex in runs.values():
        ex.run(ids, 0)
    fast = runs["kernels"].model.layers[0].fast
    assert fast.kernels
    fast.single.compiled = True  # as if compiled (uncompiled here, so the stages run eager)

    def fails(*args, **kwargs):
        raise RuntimeError("kernel broken")

    for module, name in broken:
        monkeypatch.setattr(module, name, fails)
    got = runs["kernels"].run(torch.tensor([5]), 27)
    want = runs["torch"].run(torch.tensor([5]), 27)
    bound = 1e-4 * max(1.0, float(want.abs().max()))
    assert float((got.float() - want.float()).abs().max()) <= bound
    return fast


def test_a_failing_row_kernel_turns_the_kernels_off_not_the_compiled_stages(tiny_models,
                                                                            monkeypatch):
    """A dense layer on the kernels runs nothing compiled, so a failure there (here: the GEMV
    kernels raising, then the add + norm row kernel) switches the GEMV kernels off, then the
    Triton kernels, and leaves the torch path's stages compiled; the step is then the torch
    path's, with the same logits."""
    from layersplit.shards.kernels import gemv, row_ops

    fast = _step_with_broken_kernels(tiny_models["llama"], "llama", monkeypatch,
                                     [(row_ops, "add_rms_norm"), (gemv, "gemv")])
    assert fast.kernels is False and fast.gemv is False and fast.single.compiled


@pytest.mark.skipif(DEV == "cpu", reason="the sparse one-row step's kernels load on CUDA only")
def test_a_failing_kernel_of_a_sparse_one_row_step_leaves_the_stages_compiled(tiny_models,
                                                                              monkeypatch):
    """A sparse layer's one-row step (`FusedDecode._moe_row`) runs nothing compiled either: a
    kernel failing there (here the step itself raising, as a failing launch of its routing or
    experts would) turns the Triton kernels off, not the compiled stages, and the step is the
    torch path's, with the same logits."""
    from layersplit.shards.fused import FusedDecode

    fast = _step_with_broken_kernels(tiny_models["qwen3_moe"], "qwen3_moe", monkeypatch,
                                     [(FusedDecode, "_moe_row")])
    assert fast.kernels is False and fast.single.compiled


@pytest.mark.skipif(DEV == "cpu", reason="a sparse one-row step takes `_moe_row` on CUDA only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_routing_in_the_routers_launch_equals_its_own_launch(tiny_models, monkeypatch,
                                                                 family, dtype):
    """`LAYERSPLIT_MOE_FUSED_ROUTE=1` (`gemv.gemv_route` in `FusedDecode._moe_row`): graph
    decode steps' logits equal those with the routing in its own launch bit for bit (the same
    logits, routed by the same code), the counters each sparse layer made back at zero after
    every replay."""
    from layersplit.shards import fused

    runs = {}
    for on in (False, True):
        monkeypatch.setenv(fused.FUSED_ROUTE_SWITCH, "1" if on else "0")
        runs[on] = _executor(tiny_models[family], family, dtype, True)
        runs[on].run(torch.arange(3, 33), 0)
    pos, tok = 30, 5
    for _ in range(40):  # (crossing KV buckets 32 and 64: captures and replays)
        want, got = (runs[on].run(torch.tensor([tok]), pos) for on in (False, True))
        assert torch.equal(got, want), pos
        tok, pos = int(want.argmax()), pos + 1
    fast = runs[True].model.layers[0].fast
    assert fast.fused_route and not runs[False].model.layers[0].fast.fused_route
    counters = [la.mlp.route_counter for la in runs[True].model.layers
                if hasattr(la.mlp, "experts")]
    assert counters and all(int(c) == 0 for c in counters)
    assert not any(hasattr(la.mlp, "route_counter") for la in runs[False].model.layers)
