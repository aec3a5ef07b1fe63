"""`kernels.row_argmax` (the greedy draw in two launches) against torch's `max(dim=-1)` and the
non-finite marks of `finite.greedy_draw`'s torch path: ties (the first index), a NaN anywhere
(the first NaN's index, marked), infinities, rows of one value, vocabularies that are no whole
blocks. On a CUDA device at published vocabularies; on a CPU through Triton's interpreter
(`TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards import finite
from layersplit.shards.kernels import row_argmax as ra

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
    rows = _rows(6, vocab, dtype, vocab)
    rows[1, vocab // 3] = rows[1, vocab - 1] = rows[1].max() + 1  # (a tie: the first wins)
    rows[2] = 0.5  # (one value: index 0)
    rows[3, -1] = float("nan")  # (a NaN last: it wins, marked)
    rows[3, 0] = float("inf")
    rows[4, vocab // 2] = float("inf")  # (an infinity: it wins, marked)
    rows[5, 1:] = float("-inf")  # (all but one -inf)
    ids, marked = ra.row_argmax(rows)
    want_ids, want_marked = _torch_draw(rows)
    assert ids.dtype == marked.dtype == torch.int64 and ids.shape == (6,)
    assert marked.tolist() == want_marked.tolist() == [marked[0].item(), vocab // 3, 0, -1,
                                                       -1, 0]
    assert ids[[0, 1, 2, 4, 5]].tolist() == want_ids[[0, 1, 2, 4, 5]].tolist()
    assert ids[3].item() == vocab - 1  # (the NaN's index: what a NaN-first max gives)


def test_nan_rows_and_all_minus_infinity():
    v = VOCABS[-2]
    rows = torch.full((3, v), float("-inf"), device=KERNEL_DEV)
    rows[1, 7] = rows[1, v - 2] = float("nan")
    rows[2] = float("nan")
    ids, marked = ra.row_argmax(rows)
    assert marked.tolist() == [-1, -1, -1]
    assert ids.tolist() == [0, 7, 0]


def test_greedy_draw_takes_the_kernel_and_strided_rows_take_torch():
    rows = _rows(3, VOCABS[-1], torch.float32, 1)
    ids, marked = finite.greedy_draw(rows)
    want_ids, want_marked = _torch_draw(rows)
    assert torch.equal(ids, want_ids) and torch.equal(marked, want_marked)
    wide = _rows(3, 2 * VOCABS[-1], torch.float32, 2)[:, ::2]  # (no contiguous entries)
    assert torch.equal(finite.greedy_draw(wide)[0], wide.argmax(dim=-1))
    with pytest.raises(ValueError, match="contiguous"):
        ra.row_argmax(wide)
