"""`shards.parked_rows`: a shard's parked feature rows come out as runs of consecutive positions
per draft context, in the order of their last step, and nothing stays parked after."""

import torch
from layersplit.shards.parked_rows import ParkedRows, feature_messages


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor([[v, -v] for v in values])


def test_runs_of_consecutive_positions_in_the_order_of_their_last_step():
    parked = ParkedRows()
    parked.add(10, 0, 5, _rows(5))
    parked.add(10, 1, 8, _rows(80))
    parked.add(11, 0, 6, _rows(6))
    parked.add(11, 1, 9, _rows(90))
    parked.add(12, 1, 9, _rows(91))  # (position 9 written again: a new run, sent after)
    parked.add(13, 0, 7, _rows(7))
    assert parked.count == 6
    runs = parked.take()
    assert [(r.sid, r.context, r.pos, r.end) for r in runs] == [
        (11, 1, 8, 10), (12, 1, 9, 10), (13, 0, 5, 8)]
    assert torch.equal(torch.cat(runs[2].rows), _rows(5, 6, 7))
    assert torch.equal(torch.cat(runs[0].rows), _rows(80, 90))
    assert parked.count == 0 and parked.take() == []
    parked.add(14, 0, 8, _rows(8))  # (after a take, a run starts afresh)
    assert [(r.sid, r.pos, r.end) for r in parked.take()] == [(14, 8, 9)]


def test_feature_messages_hold_at_most_a_piece_and_the_last_says_so():
    parked = ParkedRows()
    for i in range(5):
        parked.add(20 + i, 3, 10 + i, _rows(i))
    parked.add(25, 1, 0, _rows(9))
    got = list(feature_messages(parked.take(), 2, [1, 4], last=True))
    assert [(h["slot"], h["pos"], h["n"], h["sid"], h["last"]) for h, _ in got] == [
        (3, 10, 2, 24, False), (3, 12, 2, 24, False), (3, 14, 1, 24, False),
        (1, 0, 1, 25, True)]
    assert torch.equal(torch.cat([r for h, r in got[:3]]), _rows(0, 1, 2, 3, 4))
    assert got[0][0]["layers"] == [1, 4] and got[0][0]["type"] == "feat"
    parked.add(30, 0, 0, _rows(1))
    assert [h["last"] for h, _ in feature_messages(parked.take(), 2, [1], last=False)] == [False]
