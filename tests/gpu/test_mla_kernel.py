"""The MLA decode kernel (`shards.kernels.mla_decode`) against the torch absorbed form it
replaces (`MLAttention._absorbed`), through a paged executor's static steps: one-row decode
steps, a token-tree verify step, a batched decode step and a batched verify step.

On a CUDA device (`python -m pytest -m gpu`; the static steps are captured graphs there, whose
outputs are static buffers that a later replay overwrites: each is copied as it comes). On a
CPU, the same test runs through Triton's interpreter with `TRITON_INTERPRET=1` (float32 only).
Outputs agree within 1e-4 of their magnitude in float32 (the two paths sum in other orders). In
bfloat16 two summation orders of the tiny models' logits differ by a few bf16 steps (2-6 %,
`tests.gpu.test_decode_kernels`), and by far more at a step where a near-tie of the expert
routing flips (the torch path alone strays up to 0.5 from float32 at some steps, measured on a
CPU), so there each path is measured against the torch path in float32: the kernel's worst output
as close to it as twice the torch path's worst, at least 0.05.
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.gemv_linear import linears_as_gemv
from layersplit.shards.layers.mla import MLA_KERNEL_SWITCH
from layersplit.shards.layers.norm import norms_as_row_kernels

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])
LENS = (13, 21, 5)  # prompt per slot


def _outputs(path, dtype: torch.dtype, fuse: bool = False) -> list[torch.Tensor]:
    ckpt = open_checkpoint(path)
    model = load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, DEV)
    if fuse:  # (as `fuse_projections` leaves the layers: query and latent projections as one
        for layer in model.layers:  # matmul, projections of one row through the GEMV kernel)
            layer.fuse_weights()
            norms_as_row_kernels(layer)
            linears_as_gemv(layer)
    ex = RangeExecutor(model, 64, 3, device=DEV, static_decode=True, graph_bucket=16,
                       paged=(30, 8))
    order = torch.randperm(30, generator=torch.Generator().manual_seed(3)).tolist()
    for slot in range(3):  # 8 blocks = 64 rows each, interleaved across the pool
        ex.kv.set_table(slot, 0, order[slot::3][:8])
    g = torch.Generator().manual_seed(1)
    for slot, n in enumerate(LENS):
        ex.run(torch.randint(3, 300, (n,), generator=g), 0, slot)
    outs = []  # copies: a graph's outputs are overwritten by the next replay in its pool

    def keep(out: torch.Tensor) -> None:
        outs.append(out.float().cpu().clone())

    for slot, n in enumerate(LENS):  # one-row steps, in two graph buckets
        for pos in range(n, n + 4):
            keep(ex.run(torch.tensor([7 + pos]), pos, slot))
    pos = [n + 4 for n in LENS]
    rows = torch.tensor([9, 3, 5, 7, 2])
    keep(ex.run(rows, pos[0], 0, all_logits=True, verify=True, tree=[0, 1, 1, 0]))
    pos[0] += 5
    keep(ex.static.run_batch(torch.tensor([4, 8, 15]), [0, 1, 2], pos)[0])
    pos = [p + 1 for p in pos]
    keep(ex.static.run_verify_batch(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), [2, 1],
                                    pos[2:0:-1], [None, [0, 0, 1]])[0])
    return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """`a`'s largest distance from `b` per unit of `b`'s largest magnitude (at least 1)."""
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-noq"])
def test_kernel_equals_torch_path(tiny_models, family, dtype, monkeypatch):
    monkeypatch.setenv(MLA_KERNEL_SWITCH, "0")
    want = _outputs(tiny_models[family], dtype)
    ref = want if dtype == torch.float32 else _outputs(tiny_models[family], torch.float32)
    monkeypatch.setenv(MLA_KERNEL_SWITCH, "1")
    got = _outputs(tiny_models[family], dtype, fuse=True)
    assert [a.shape for a in got] == [b.shape for b in want] == [r.shape for r in ref]
    if dtype == torch.float32:
        for i, (a, b) in enumerate(zip(got, want)):
            assert _rel(a, b) <= 1e-4, (i, _rel(a, b))
        return
    kernel = [_rel(a, r) for a, r in zip(got, ref)]
    torch_path = [_rel(b, r) for b, r in zip(want, ref)]
    assert max(kernel) < max(0.05, 2 * max(torch_path)), (kernel, torch_path)


def test_a_failing_one_launch_rows_step_takes_the_two(tiny_models, monkeypatch, caplog):
    """Where the one-launch latent and query rows (`rows_and_queries`) fail to build, the step
    takes `mla_rows` and `heads_matmul` from then on (said once), not the torch path, and
    answers the same."""
    from layersplit.shards.kernels import mla_step
    from layersplit.shards.layers import mla

    monkeypatch.setenv(MLA_KERNEL_SWITCH, "0")
    want = _outputs(tiny_models["deepseek_v3"], torch.float32)
    monkeypatch.setenv(MLA_KERNEL_SWITCH, "1")
    monkeypatch.setattr(mla, "_KERNEL", {})
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(mla_step, "rows_and_queries", broken)
    got = _outputs(tiny_models["deepseek_v3"], torch.float32, fuse=True)
    assert len(calls) == 1 and mla._KERNEL == {"rows off": True}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert _rel(a, b) <= 1e-4, (i, _rel(a, b))
    assert sum("two launches" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("rank,rope,rows,t,chunk,off32", [
    (32, 8, 1, 600, 256, True), (27, 8, 3, 600, 256, True), (512, 64, 1, 600, 256, True),
    (32, 8, 2, 2400, 256, True), (32, 8, 2, 2400, 16, True), (512, 64, 2, 600, 256, False)])
def test_key_splits_combine(rank, rope, rows, t, chunk, off32, monkeypatch):
    """Keys spread over several splits (600 keys: 19 of 32 on an H200; 2,400: 75, read by the
    combine in one load, or, splits of 64 keys on any device (38), in 3 loads of 16; the pool
    addressed in int32 offsets or, as a pool of 2**31 values is, in int64), rows
    read through a shuffled pool index, a mask that hides the last keys: the kernel's latent
    output equals the plain softmax over each sequence's latent rows. In float32, at DeepSeek's
    latent width too (512 + 64: its keys' blocks once asked more shared memory than an H200
    has)."""
    from layersplit.shards.kernels import mla_decode as mod
    from layersplit.shards.kernels.decode_attention import SPLIT_ENV

    monkeypatch.setitem(mod.COMBINE, "splits", chunk)
    if not off32:
        monkeypatch.setattr(mod, "OFF32_LIMIT", 0)
    if chunk < 256:
        monkeypatch.setenv(SPLIT_ENV, "64")
    g = torch.Generator().manual_seed(0)
    s, heads = 2, 4
    half = -(-(rank + rope) // 2)
    pool = torch.randn(s * t + 5, 2 * half, generator=g).to(DEV)
    index = torch.randperm(s * t + 5, generator=g)[:s * t].view(s, t).to(DEV)
    q = torch.randn(s, rows * heads, rank + rope, generator=g).to(DEV)
    mask = torch.ones(s * rows, t, dtype=torch.bool)
    mask[:, t - 10:] = False
    mask[1, 100:] = False  # (mask row 1, of the first sequence or the second, sees 100 keys)
    mask = mask.to(DEV)
    got = mod.mla_decode(q, pool[:, :half], pool[:, half:], index, mask, heads, rank, 0.3)
    lat = pool[index][..., :rank + rope]  # (S, T, L)
    scores = torch.einsum("sml,stl->smt", q, lat) * 0.3
    seen = mask.view(s, rows, 1, t).expand(s, rows, heads, t).reshape(s, rows * heads, t)
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    want = torch.einsum("smt,stc->smc", probs, lat[..., :rank])
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank,rope,rows,t,v,split", [
    (32, 8, 1, 600, 24, None), (27, 8, 2, 600, 16, None), (512, 64, 1, 300, 128, None),
    (32, 8, 5, 600, 100, 64), (32, 8, 2, 2400, 40, 16), (32, 8, 1, 40, 24, 0)])
def test_w_uv_in_the_combine_equals_the_combine_then_heads_matmul(rank, rope, rows, t, v, split,
                                                                 dtype, monkeypatch):
    """`mla_decode(..., w_uv=)`: the latent output times each row's head's W_UV in the
    combine's launch (`_mla_combine_uv`: V in several programs' tiles, a V no multiple of
    them, 20 query rows in two tiles) equals `heads_matmul` of the latent output, as do the
    steps that run the two apart: keys in more than `UV_MAX_SPLITS` splits (2,400 keys in
    splits of 16) and in one (`split` 0); a W_UV of the wrong shape is refused. bfloat16
    (on a GPU): the latent output rounded as `_mla_combine` writes it, then the product."""
    from layersplit.shards.kernels import mla_decode as mod
    from layersplit.shards.kernels.decode_attention import SPLIT_ENV, key_split
    from layersplit.shards.kernels.mla_step import heads_matmul

    if split is not None:
        monkeypatch.setenv(SPLIT_ENV, str(split))
    g = torch.Generator().manual_seed(4)
    s, heads = 2, 4
    half = -(-(rank + rope) // 2)
    pool = torch.randn(s * t + 5, 2 * half, generator=g).to(DEV, dtype)
    index = torch.randperm(s * t + 5, generator=g)[:s * t].view(s, t).to(DEV)
    q = torch.randn(s, rows * heads, rank + rope, generator=g).to(DEV, dtype)
    kv_b = (torch.randn(heads, v, rank, generator=g) * rank ** -0.5).to(DEV, dtype)  # (W_UV)
    w_uv = kv_b.transpose(1, 2)  # (H, C, V): `_kv_b`'s view, no copy
    args = (q, pool[:, :half], pool[:, half:], index, None, heads, rank, 0.3)
    splits = key_split(t, s * -(-rows * heads // mod.BLOCK_M), torch.device(DEV),
                       block=mod.SPLIT_KEYS)[0]
    assert (1 < splits <= mod.UV_MAX_SPLITS) == (split in (None, 64)), splits
    lat = mod.mla_decode(*args)
    want = torch.empty(s * rows, heads, v, device=DEV, dtype=dtype)
    heads_matmul(lat.view(s * rows, heads, rank), w_uv, want, block_n=16)
    got = mod.mla_decode(*args, w_uv=w_uv)
    assert got.shape == (s, rows * heads, v) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # (bf16: sums in another order, rounded)
    scale = max(1.0, float(want.abs().max()))
    assert float((got.view_as(want).float() - want.float()).abs().max()) <= tol * scale
    with pytest.raises(ValueError, match="w_uv"):
        mod.mla_decode(*args, w_uv=w_uv[:, :-1])


@pytest.mark.parametrize("uv", ["1", "0"])
def test_w_uv_in_the_combine_in_the_model_equals_the_torch_path(tiny_models, monkeypatch, uv):
    """W_UV in the key splits' combine (`LAYERSPLIT_MLA_COMBINE_UV`, on by default; 0: the
    combine, then `heads_matmul`) through a paged executor's captured steps (one-row, tree
    verify, batched, batched verify), every step's keys split (in 16s): the same outputs as
    the torch path's, float32, with no kernel turned off on the way; switched off, the
    combine's W_UV launch never runs."""
    from layersplit.shards.kernels import mla_decode as mod
    from layersplit.shards.kernels.decode_attention import SPLIT_ENV
    from layersplit.shards.layers import mla
    from layersplit.shards.layers.mla import COMBINE_UV_SWITCH

    monkeypatch.setenv(MLA_KERNEL_SWITCH, "0")
    want = _outputs(tiny_models["deepseek_v3"], torch.float32)
    monkeypatch.setenv(MLA_KERNEL_SWITCH, "1")
    monkeypatch.setenv(COMBINE_UV_SWITCH, uv)
    monkeypatch.setenv(SPLIT_ENV, "16")
    monkeypatch.setattr(mod, "SPLIT_KEYS", 16)  # (steps of several query tiles: splits of 16)
    monkeypatch.setattr(mla, "_KERNEL", {})
    launches = []
    kernel = mod._mla_combine_uv

    class Counted:  # (the kernel, its launches' grids kept)
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(mod, "_mla_combine_uv", Counted())
    got = _outputs(tiny_models["deepseek_v3"], torch.float32, fuse=True)
    assert not mla._KERNEL  # (nothing failed: no torch path ran in its place)
    if uv == "0":
        assert launches == []
    else:
        assert {g[0] > 1 for g in launches} == {True, False}  # (batched steps' and lone ones')
        assert any(g[1] > 16 for g in launches)  # (a verify step's rows: more than a tile)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert _rel(a, b) <= 1e-4, (i, _rel(a, b))


def test_no_key_past_a_sequences_last_row_is_read():
    """`last` (the rows each sequence writes in the step): a program reads no key past its
    sequence's last row. Those keys' latent rows are NaN here, which a read would carry into
    the output even under the mask (0 x NaN); the output equals the softmax over the keys
    each query row sees, whether the keys are split or not."""
    from layersplit.shards.kernels import mla_decode as mod

    g = torch.Generator().manual_seed(1)
    s, rows, heads, rank, rope, t = 2, 2, 4, 32, 8, 300
    half = (rank + rope) // 2
    written = torch.tensor([[150, 151], [40, 41]])  # (S, rows): each step row's own key
    pool = torch.randn(s * t, 2 * half, generator=g)
    index = torch.arange(s * t).view(s, t)
    for i in range(s):
        pool[index[i, int(written[i].max()) + 1:]] = float("nan")
    mask = torch.arange(t)[None, :] <= written.reshape(-1, 1)  # (S * rows, T)
    q = torch.randn(s, rows * heads, rank + rope, generator=g)
    lat = pool.nan_to_num(0.0)[index][..., :rank + rope]
    scores = torch.einsum("sml,stl->smt", q, lat) * 0.3
    seen = mask.view(s, rows, 1, t).expand(s, rows, heads, t).reshape(s, rows * heads, t)
    want = torch.einsum("smt,stc->smc",
                        torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1),
                        lat[..., :rank])
    saved = mod.SPLIT_KEYS, mod.SPLIT_KEYS_ALONE
    for split in (16, 32, 64, 1024):  # (several splits, and one: the output written directly)
        mod.SPLIT_KEYS = mod.SPLIT_KEYS_ALONE = split
        try:
            got = mod.mla_decode(q.to(DEV), pool[:, :half].to(DEV), pool[:, half:].to(DEV),
                                 index.to(DEV), mask.to(DEV), heads, rank, 0.3,
                                 last=written.reshape(-1).to(DEV))
        finally:
            mod.SPLIT_KEYS, mod.SPLIT_KEYS_ALONE = saved
        assert torch.isfinite(got).all()
        assert float((got.cpu() - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("split", [16, 48])
def test_a_lone_sequence_in_splits_shorter_than_the_loops_block(split, monkeypatch):
    """Batch 1 (one sequence whose query rows fit one tile) takes `SPLIT_KEYS_ALONE`: splits of
    16 keys where the loop reads blocks of 32 (bfloat16 rows; float32's are 16, so the loop's
    block is doubled here), the block's other half masked, or 48 (a block and a half)."""
    from layersplit.shards.kernels import mla_decode as mod

    monkeypatch.setattr(mod, "SPLIT_KEYS_ALONE", split)
    monkeypatch.setattr(mod, "BLOCK_N", 64)  # (float32: loops of 32 keys)
    g = torch.Generator().manual_seed(2)
    heads, rank, rope, t = 4, 32, 8, 600
    half = (rank + rope) // 2
    pool = torch.randn(t + 7, 2 * half, generator=g)
    index = torch.randperm(t + 7, generator=g)[:t].view(1, t)
    q = torch.randn(1, heads, rank + rope, generator=g)
    mask = torch.ones(1, t, dtype=torch.bool)
    mask[:, t - 5:] = False
    got = mod.mla_decode(q.to(DEV), pool[:, :half].to(DEV), pool[:, half:].to(DEV),
                         index.to(DEV), mask.to(DEV), heads, rank, 0.3)
    lat = pool[index][..., :rank + rope]  # (1, T, L)
    scores = torch.einsum("sml,stl->smt", q, lat) * 0.3
    probs = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    want = torch.einsum("smt,stc->smc", probs, lat[..., :rank])
    assert float((got.cpu() - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("heads,rank,rope,interleave", [
    (16, 512, 64, False), (128, 512, 64, True),  # (DeepSeek-V2-Lite's heads; V3's and Kimi's)
    (3, 27, 6, True)])  # (an odd latent width: the row's padding value)
def test_latent_rows_and_query_rotary_equal_the_torch_ops(heads, rank, rope, interleave):
    """`mla_step.mla_rows` writes each step row's latent row (kv_a_layernorm on c, the rotary
    on k_pe) into its pool row's two halves and the queries' rotary parts into the query rows,
    as the torch path's norm, rotary, cat and pad compute them."""
    from layersplit.shards.kernels.mla_step import mla_rows
    from layersplit.shards.layers.mla import LATENT_NORM_EPS, apply_rope_interleaved
    from layersplit.shards.layers.norm import RMSNorm
    from layersplit.shards.layers.rotary import apply_rope

    g = torch.Generator().manual_seed(2)
    n, latent = 3, rank + rope
    half = -(-latent // 2)
    a = torch.randn(n, latent + 5, generator=g)[:, :latent]  # (a slice of wider rows)
    q_pe = torch.randn(n, heads, rope + 7, generator=g)[..., 7:]
    norm = RMSNorm(rank, LATENT_NORM_EPS)
    norm.weight.data = torch.randn(rank, generator=g)
    ang = torch.rand(n, rope // 2, generator=g) * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    write = torch.tensor([7, 2, 11])
    k_pool, v_pool = torch.zeros(16, half), torch.zeros(16, half)
    q_out = torch.zeros(n, heads, latent)
    to = {"device": DEV}
    k_dev, v_dev, q_dev = k_pool.to(**to), v_pool.to(**to), q_out.to(**to)
    mla_rows(a.to(**to), norm.weight.to(**to), norm.eps, cos.to(**to), sin.to(**to),
             write.to(**to), k_dev, v_dev, q_pe.to(**to), q_dev, interleave)
    rot = apply_rope_interleaved if interleave else apply_rope
    row = torch.cat([norm(a[:, :rank]), rot(a[:, None, rank:], cos, sin)[:, 0]], -1)
    row = torch.nn.functional.pad(row, (0, 2 * half - latent))
    torch.testing.assert_close(torch.cat([k_dev, v_dev], -1).cpu()[write], row,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_dev.cpu()[..., rank:], rot(q_pe, cos, sin), rtol=1e-5,
                               atol=1e-5)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[write] = False
    assert not k_dev.cpu()[untouched].any() and not v_dev.cpu()[untouched].any()


@pytest.mark.parametrize("n,heads,rank,rope,nope,interleave", [
    (1, 16, 512, 64, 128, False),  # (DeepSeek-V2-Lite's decode row)
    (3, 4, 27, 6, 8, True),  # (an odd latent width)
    (17, 3, 32, 8, 16, False)])  # (rows past one block of 16)
def test_rows_and_queries_in_one_launch_equal_the_two(n, heads, rank, rope, nope, interleave):
    """`mla_step.rows_and_queries` writes the same latent rows and query rows, bit for bit, as
    `mla_rows` and `heads_matmul` (W_UK) in two launches."""
    from layersplit.shards.kernels.mla_step import heads_matmul, mla_rows, rows_and_queries

    g = torch.Generator().manual_seed(n + heads)
    latent = rank + rope
    half = -(-latent // 2)
    dt = torch.float32 if DEV == "cpu" else torch.bfloat16
    to = {"device": DEV, "dtype": dt}
    a = torch.randn(n, latent, generator=g).to(**to)
    q = torch.randn(n, heads, nope + rope, generator=g).to(**to)  # (q_nope, then q_pe)
    w_uk = (torch.randn(heads, nope, rank, generator=g) * nope ** -0.5).to(**to)
    nw = torch.randn(rank, generator=g).to(**to)
    ang = torch.rand(n, rope // 2, generator=g) * 6
    cos = torch.cat([ang, ang], -1).cos().to(**to)
    sin = torch.cat([ang, ang], -1).sin().to(**to)
    write = torch.randperm(2 * n + 3, generator=g)[:n].to(DEV)
    outs = []
    for fused in (False, True):
        k_pool = torch.zeros(2 * n + 3, half, **to)
        v_pool = torch.zeros(2 * n + 3, half, **to)
        q_row = torch.full((n, heads, latent), 7.0, **to)
        if fused:
            rows_and_queries(a, nw, 1e-6, cos, sin, write, k_pool, v_pool, q[..., nope:],
                             q[..., :nope], w_uk, q_row, interleave)
        else:
            mla_rows(a, nw, 1e-6, cos, sin, write, k_pool, v_pool, q[..., nope:], q_row,
                     interleave)
            heads_matmul(q[..., :nope], w_uk, q_row[..., :rank])
        outs.append((k_pool, v_pool, q_row))
    for two, one in zip(*outs, strict=True):
        assert torch.equal(one, two)
    assert not (outs[1][2] == 7.0).any()  # (every value of the query rows written)


def test_operands_of_the_wrong_shape_are_refused_by_name():
    """The MLA step's kernels refuse operands they would misread, before any launch: a `last`
    of the wrong length, pool halves too narrow or too wide for the latent row, or strided,
    per-head matrices that do not match the rows, an odd rotary."""
    from layersplit.shards.kernels.mla_decode import mla_decode
    from layersplit.shards.kernels.mla_step import heads_matmul, mla_rows

    q = torch.randn(1, 4, 40, device=DEV)
    pool = torch.randn(8, 20, device=DEV)
    index = torch.arange(8, device=DEV)[None]
    with pytest.raises(ValueError, match="mla_decode.*last"):
        mla_decode(q, pool, pool, index, None, 4, 32, 0.3,
                   last=torch.zeros(3, dtype=torch.long, device=DEV))
    for k_pool in (pool[:, :19], torch.randn(8, 40, device=DEV), pool.t().contiguous().t()):
        with pytest.raises(ValueError, match="mla_decode: a latent row of 40 values"):
            mla_decode(q, k_pool, pool, index, None, 4, 32, 0.3)
    with pytest.raises(ValueError, match="heads_matmul"):
        heads_matmul(torch.randn(2, 4, 16, device=DEV), torch.randn(4, 8, 32, device=DEV),
                     torch.empty(2, 4, 32, device=DEV))
    with pytest.raises(ValueError, match="mla_rows.*even rotary"):
        mla_rows(torch.randn(1, 37, device=DEV), torch.ones(32, device=DEV), 1e-6,
                 torch.ones(1, 5, device=DEV), torch.zeros(1, 5, device=DEV),
                 torch.zeros(1, dtype=torch.long, device=DEV), pool, pool,
                 torch.randn(1, 4, 5, device=DEV), torch.empty(1, 4, 37, device=DEV), False)
