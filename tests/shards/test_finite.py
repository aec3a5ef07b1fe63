"""Non-finite logits are marked, never drawn from (`shards.finite`)."""

from __future__ import annotations

import math

import pytest
import torch
from layersplit.shards.finite import bad_segments, greedy_draw, mark_rows, nonfinite_error


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_greedy_draw_marks_a_row_with_nan_or_inf_anywhere(bad):
    rows = torch.randn(3, 50)
    rows[1, 7] = bad  # (not the row's largest finite value's place)
    ids, marked = greedy_draw(rows)
    assert ids.tolist()[0] == rows[0].argmax().item()
    assert marked.tolist() == [ids[0].item(), -1, ids[2].item()]


def test_mark_rows_and_bad_segments_see_any_nonfinite_value():
    rows = torch.randn(2, 9)
    rows[0, 3] = -math.inf
    assert mark_rows(rows, torch.tensor([4, 5])).tolist() == [-1, 5]
    a, b, c = torch.randn(1, 9), torch.randn(4, 9), torch.randn(2, 9)
    b[2, 0] = math.nan
    assert bad_segments([a, b, c]) == [1]
    assert bad_segments([]) == []


def test_the_error_names_dtype_positions_and_layers():
    e = nonfinite_error("float16", [40, 41], "15:30")
    assert "position 40, 41" in str(e) and "float16" in str(e) and "15:30" in str(e)
