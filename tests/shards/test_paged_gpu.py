"""The paged GPU decode path: the Triton decode kernel reading and writing K/V through
block tables, and CUDA graphs over a paged pool keyed by rows / batch size and KV-length bucket,
not by slot.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances as `tests/gpu/test_decode_kernels.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections, pre_attention, rms_norm
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.kv_cache import KVCache, KVLayout
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.spec_tree import ancestors, depths

from tests.gpu import near
from tests.gpu.test_decode_kernels import DEV, DTYPES, _attention, _random_tree, _rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]

KB = 16  # rows per block


def _scrambled(blocks: int, seqs: int, per_seq: int, seed: int) -> list[list[int]]:
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[s * per_seq:(s + 1) * per_seq] for s in range(seqs)]


CASES = [  # family, heads, kv heads, head dim, window, kind, rows, keys attended, split keys
    ("llama", 9, 3, 64, None, "decode", 1, 256, None),
    ("qwen3", 8, 2, 128, None, "decode", 1, 200, 64),
    ("qwen2", 4, 2, 32, 40, "decode", 1, 128, None),
    ("llama", 4, 2, 16, 24, "tree", 7, 128, 64),
    ("llama", 9, 3, 64, None, "tree", 31, 600, 128),  # 3 query tiles x 5 key splits
    ("qwen3", 8, 2, 32, None, "batched", 4, 160, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kernel_matches_gather_and_reference(case, dtype):
    """One layer: the kernel over a pool whose sequences' blocks are scrambled, against the
    torch path (`pre_attention` + `KVCache.append` + `Attention._grouped`) on contiguous slots
    holding the same rows (gathered through the tables); the rows the kernel wrote, gathered
    back, equal the torch path's."""
    from layersplit.shards.kernels.decode_attention import decode_attention

    family, h, g, d, window, kind, n, kv_len, split = case
    torch.manual_seed(CASES.index(case))
    a = _attention(family, h, g, d, window, dtype)
    seqs = n if kind == "batched" else 1
    per_seq = -(-(kv_len + 16) // KB)
    max_len = per_seq * KB
    blocks = per_seq * seqs + 5
    paged = PagedKVCache(KVLayout(1, g, d, dtype), max_len, seqs, blocks, KB, DEV)
    paged.k_store.normal_()
    paged.v_store.normal_()
    for s, ids in enumerate(_scrambled(blocks, seqs, per_seq, seed=3)):
        paged.set_table(s, 0, ids)
    plain = KVCache(KVLayout(1, g, d, dtype), max_len, seqs, DEV)  # the same rows, contiguous
    for s in range(seqs):
        k, v = paged.get_rows(s, list(range(max_len)))
        plain.k[:, s], plain.v[:, s] = k, v
    x = torch.randn(n, 64, device=DEV, dtype=dtype)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    if kind == "batched":
        positions = torch.randint(0, kv_len, (n,), device=DEV)
        positions[1] = paged.scratch_pos  # a padding row: writes nothing the others read
        step = StepInfo.batched(positions, 0, kv_len)
        rows, slot = positions, None
        tables = paged.table.clone()
        tables[1] = paged.num_blocks  # a padding row's table: the scratch block only
    else:
        pos = torch.tensor([kv_len - n - 3], device=DEV)
        if kind == "decode":
            step = StepInfo.static(pos, 1, kv_len)
        else:
            parents = _random_tree(n)
            step = StepInfo.static_tree(pos, torch.tensor(depths(parents), device=DEV),
                                        ancestors(parents).to(DEV), kv_len)
        rows = step.positions if step.rows is None else step.rows
        slot, tables = 0, paged.table[0:1]
    freqs = step.positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    mask = step.mask_for(a.window)
    eps = 1e-6
    qn = None if a.q_norm is None else a.q_norm.weight
    kn = None if a.k_norm is None else a.k_norm.weight
    ones = torch.ones(64, device=DEV, dtype=dtype)
    with torch.inference_mode():
        q, k, v = pre_attention(x, ones, a.qkv_proj.weight, a.qkv_proj.bias, qn, kn, cos, sin,
                                eps, h, g, d, kind != "batched")
        if kind == "batched":
            keys, values = plain.append_batch(0, step, k, v)
            want = a._grouped_batch(q, keys, values, mask)
        else:
            keys, values = plain.append(0, slot, step, k, v)
            want = a._grouped(q, keys, values, mask)
        qkv = F.linear(rms_norm(x, ones, eps), a.qkv_proj.weight, a.qkv_proj.bias)
        got = decode_attention(qkv, cos, sin, paged.k_store[0], paged.v_store[0], rows, 0, mask,
                               seqs, h, qn, kn, eps, split, tables.contiguous())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    live = [s for s in range(seqs) if not (kind == "batched" and s == 1)]
    if kind == "batched":
        got, want = got[live], want[live]
    assert torch.isfinite(got).all()
    assert _rel(got, want) < tol, _rel(got, want)
    atol = 1e-5 if dtype == torch.float32 else 4e-2
    for s in live:  # every row of each live sequence, read back through its table
        k, v = paged.get_rows(s, list(range(max_len)))
        assert torch.equal(v, plain.v[:, s])
        assert float((k.float() - plain.k[:, s].float()).abs().max()) <= atol


def _executor(path, dtype: torch.dtype, kernels: bool, paged: bool, slots: int = 3):
    model = load_layer_range(open_checkpoint(path), 0, 6, dtype, DEV)
    fuse_projections(model, compile=DEV != "cpu", kernels=kernels)
    ex = RangeExecutor(model, 256, slots, device=DEV, static_decode=True, graph_bucket=32,
                       paged=(3 * 16 + 4, KB) if paged else None)
    if paged:  # scrambled tables across the pool
        for s, ids in enumerate(_scrambled(3 * 16 + 4, slots, 16, seed=5)):
            ex.kv.set_table(s, 0, ids)
    return ex


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_graphs_match_contiguous(tiny_models, dtype):
    """A whole 6-layer model over a paged pool with the kernels and graphs, against the torch
    decode path over contiguous slots: prefill, decode steps replayed at several lengths
    (crossing KV buckets 32, 64, 96), in two slots through the same graphs, a tree verify step
    and a batched step over slots [2, 0]."""
    path = tiny_models["qwen3"]
    runs = {"paged": _executor(path, dtype, True, True),
            "torch": _executor(path, dtype, False, False)}
    tol = 1e-3 if dtype == torch.float32 else 0.1
    ids = torch.arange(3, 40)
    for ex in runs.values():
        for slot in range(3):
            ex.run(ids[:30 + slot], 0, slot)

    def same(outs: dict) -> None:
        assert near(outs["paged"], outs["torch"], tol), \
            float((outs["paged"].float().cpu() - outs["torch"].float().cpu()).abs().max())

    assert runs["paged"].model.layers[0].fast.kernels  # the kernels ran (no fallback)
    steps = 8 if DEV == "cpu" else 70
    for slot in (0, 1):
        pos, tok = 30 + slot, 5
        for _ in range(steps):
            outs = {k: ex.run(torch.tensor([tok]), pos, slot) for k, ex in runs.items()}
            same(outs)
            tok, pos = int(outs["torch"].argmax()), pos + 1
    static = runs["paged"].static
    if static.capture:  # one graph per (rows, bucket) for both slots: not keyed by slot
        assert {key[0] for key in static.graphs} == {-1}
        assert len(static.graphs) == len({key[1] for key in static.graphs})
    parents = [0, 0, 1, 1, 2, 3]
    same({k: ex.static.run(torch.tensor([tok, 7, 9, 11, 4, 6, 8]), pos, 1, parents)[0].clone()
          for k, ex in runs.items()})
    same({k: ex.static.run_batch(torch.tensor([6, 7]), [2, 0], [40, 30 + steps]).clone()
          for k, ex in runs.items()})
    kv, ref = runs["paged"].kv, runs["torch"].kv
    for s, end in ((0, 30 + steps), (2, 41)):  # the rows each wrote, through the tables
        k, _ = kv.get_rows(s, list(range(end)))
        assert near(k, ref.k[:, s, :end], tol)
