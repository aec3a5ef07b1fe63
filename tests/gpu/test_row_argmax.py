"""`kernels.row_argmax` (the greedy draw in two launches) against torch's `max(dim=-1)` and the
non-finite marks of `finite.greedy_draw`'s torch path: ties (the first index), a NaN anywhere
(the first NaN's index, marked), infinities, rows of one value, vocabularies that are no whole
blocks, rows apart in memory. On a CUDA device at published vocabularies; on a CPU through
Triton's interpreter (`TRITON_INTERPRET=1`). (The kernel module imports Triton: each test
imports it where it runs.)"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards import finite

from tests.gpu import KERNEL_DEV, kernel_marks

pytestmark = kernel_marks()
VOCABS = [102400, 151936, 5000] if KERNEL_DEV != "cpu" else [5000, 2048, 7]


def _torch_draw(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, ids = rows.max(dim=-1)
    return ids, ids.masked_fill(~torch.isfinite(top), -1)


def _rows(n: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=KERNEL_DEV).manual_seed(seed)
    return (torch.randn(n, v, generator=g, device=KERNEL_DEV) * 4).to(dtype)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_argmax_equals_torch(vocab, dtype):
    from layersplit.shards.kernels.row_argmax import row_argmax

    rows = _rows(6, vocab, dtype, vocab)
    rows[1, vocab // 3] = rows[1, vocab - 1] = rows[1].max() + 1  # (a tie: the first wins)
    rows[2] = 0.5  # (one value: index 0)
    rows[3, -1] = float("nan")  # (a NaN last: it wins, marked)
    rows[3, 0] = float("inf")
    rows[4, vocab // 2] = float("inf")  # (an infinity: it wins, marked)
    rows[5, 1:] = float("-inf")  # (all but one -inf)
    ids, marked = row_argmax(rows)
    want_ids, want_marked = _torch_draw(rows)
    assert ids.dtype == marked.dtype == torch.int64 and ids.shape == (6,)
    assert marked.tolist() == want_marked.tolist() == [marked[0].item(), vocab // 3, 0, -1,
                                                       -1, 0]
    assert ids[[0, 1, 2, 4, 5]].tolist() == want_ids[[0, 1, 2, 4, 5]].tolist()
    assert ids[3].item() == vocab - 1  # (the NaN's index: what a NaN-first max gives)


def test_nan_rows_and_all_minus_infinity():
    from layersplit.shards.kernels.row_argmax import row_argmax

    v = 5000  # (three blocks: the first NaN's block is not the first)
    rows = torch.full((4, v), float("-inf"), device=KERNEL_DEV)
    rows[1, 2100] = rows[1, v - 2] = float("nan")
    rows[2] = float("nan")
    rows[3, 4500] = 1.0
    rows[3, 2200] = float("nan")
    ids, marked = row_argmax(rows)
    assert marked.tolist() == [-1, -1, -1, -1]
    assert ids.tolist() == [0, 2100, 0, 2200]


def test_rows_apart_in_memory():
    """Rows of a wider tensor (a row stride past V) are read where they lie."""
    from layersplit.shards.kernels.row_argmax import row_argmax

    v = VOCABS[-1]
    wide = _rows(5, v + 300, torch.float32, 3)
    rows = wide[:, :v]
    assert torch.equal(row_argmax(rows)[1], _torch_draw(rows)[1])


def test_greedy_draw_takes_the_kernel_unless_switched_off(monkeypatch):
    """`greedy_draw` runs the kernel where it takes the rows (spied), torch's ops with the
    switch off and for rows it does not take (entries apart, float64); a row it refuses
    raises ValueError, which does not turn the kernel off."""
    from layersplit.shards.kernels import kernel_failed
    from layersplit.shards.kernels import row_argmax as ra

    calls = []
    real = ra.row_argmax
    monkeypatch.setattr(ra, "row_argmax", lambda rows: calls.append(rows.shape) or real(rows))
    rows = _rows(3, VOCABS[-1], torch.float32, 1)
    ids, marked = finite.greedy_draw(rows)
    want_ids, want_marked = _torch_draw(rows)
    assert torch.equal(ids, want_ids) and torch.equal(marked, want_marked)
    assert calls == [rows.shape]
    monkeypatch.setenv(finite.ARGMAX_SWITCH, "0")
    assert torch.equal(finite.greedy_draw(rows)[1], want_marked) and len(calls) == 1
    monkeypatch.delenv(finite.ARGMAX_SWITCH)
    apart = _rows(3, 2 * VOCABS[-1], torch.float32, 2)[:, ::2]  # (no contiguous entries)
    doubles = torch.full((2, 9), 1e300, dtype=torch.float64, device=KERNEL_DEV)
    for refused in (apart, doubles):
        assert not ra.takes(refused)
        assert torch.equal(finite.greedy_draw(refused)[1], _torch_draw(refused)[1])
        with pytest.raises(ValueError, match="contiguous"):
            real(refused)
    assert len(calls) == 1 and not kernel_failed(finite.ARGMAX)
