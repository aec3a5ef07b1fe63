"""`shards.parked_rows`: a shard's parked feature rows come out as runs of consecutive positions
per draft context, in the order of their last step, and nothing stays parked after; through a
real runtime, rows parked for one sequence never land in the next one's positions, and a step
that is not parked sends them even where it is refused."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from layersplit.draft.dflash import write_random_dflash
from layersplit.ipc.messages import message
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.generate import StepRequest
from layersplit.shards.executor import GroupTaps, Segment
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.parked_rows import (
    PARK_BYTES,
    PARK_ROWS,
    PARK_ROWS_MAX,
    ParkedRows,
    adjacent,
    feature_messages,
    park_capacity,
)
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.worker_steps import StepRunner


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor([[v, -v] for v in values], dtype=torch.float32)


def _parts(*values: float) -> list[torch.Tensor]:
    """The rows of `_rows` as two tapped layers' (side by side once parked)."""
    rows = _rows(*values)
    return [rows[:, :1], rows[:, 1:]]


def test_runs_of_consecutive_positions_in_the_order_of_their_last_step():
    parked = ParkedRows()
    parked.add(10, 0, 5, _parts(5))
    parked.add(10, 1, 8, _parts(80))
    parked.add(11, 0, 6, _parts(6))
    parked.add(11, 1, 9, _parts(90))
    parked.add(12, 1, 9, _parts(91))  # (position 9 written again: a new run, sent after)
    parked.add(13, 0, 7, _parts(7))
    assert parked.count == 6
    runs = parked.take()
    assert [(r.sid, r.context, r.pos, r.end) for r in runs] == [
        (11, 1, 8, 10), (12, 1, 9, 10), (13, 0, 5, 8)]
    assert torch.equal(torch.cat(runs[2].rows), _rows(5, 6, 7))
    assert torch.equal(torch.cat(runs[0].rows), _rows(80, 90))
    assert parked.count == 0 and parked.take() == []
    parked.add(14, 0, 8, _parts(8))  # (after a take, a run starts afresh)
    assert [(r.sid, r.pos, r.end) for r in parked.take()] == [(14, 8, 9)]


def test_a_parked_step_costs_the_same_however_many_rows_are_parked(monkeypatch):
    """A step's rows go into the one buffer by one copy, and a run of a sequence's steps is
    one view of it (no gathering when sent); parking a step does not look at the rows parked
    before it (it once summed the run's rows at each step: quadratic in a request's length)."""
    looked = []
    length = torch.Tensor.__len__
    monkeypatch.setattr(torch.Tensor, "__len__", lambda t: looked.append(1) or length(t))
    parked = ParkedRows()
    for i in range(2000):
        parked.add(i, 0, 10 + i, _parts(i))
        if i == 999:
            parked.add(i, 1, 0, _parts(-1.0))  # (another context's row between: two pieces)
    assert len(looked) < 100, len(looked)
    monkeypatch.setattr(torch.Tensor, "__len__", length)
    runs = parked.take()
    assert [(r.context, r.pos, r.end, [len(p) for p in r.rows]) for r in runs] == [
        (1, 0, 1, [1]), (0, 10, 2010, [1000, 1000])]
    assert torch.equal(torch.cat(runs[1].rows), _rows(*range(2000)))


def test_a_batched_step_parks_its_sequences_rows_by_one_copy(monkeypatch):
    """A step of several sequences, their rows one after the other in each tapped layer's
    output (`adjacent`), is parked by one copy (`add_step`), into the same runs and rows as a
    copy per sequence; rows apart, or of another tensor, are not taken as one."""
    out = torch.arange(40.0).reshape(10, 4)  # a tapped layer's rows of a step of 3 sequences
    views = [out[0:1], out[1:4], out[4:5]]
    assert torch.equal(adjacent(views), out[0:5]) and adjacent(views[:1]) is views[0]
    assert adjacent([out[0:1], out[2:3]]) is None  # (a row between: another sequence's)
    assert adjacent([out[0:1], out.clone()[1:2]]) is None
    assert torch.equal(adjacent([out[0:2, :2], out[2:3, :2]]), out[0:3, :2])  # (columns)
    assert adjacent([]) is None and adjacent([out[0:1], out.half()[1:2]]) is None
    one, each = ParkedRows(), ParkedRows()
    copies = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: copies.append(1) or cat(*a, **k))
    for step in range(4):  # three sequences of one row each, then a wider one
        rows = torch.arange(step * 10.0, step * 10 + 5).reshape(5, 1)
        parts = [rows, -rows]
        segs = [(0, 7 + step, 1), (1, 3 + step, 3 if step == 3 else 1), (2, step, 1)]
        n = sum(r for _, _, r in segs)
        one.add_step(step, segs, [p[:n] for p in parts])
        a = 0
        for context, pos, r in segs:
            each.add(step, context, pos, [p[a:a + r] for p in parts])
            a += r
    assert len(copies) == 4 + 4 * 3
    monkeypatch.setattr(torch, "cat", cat)
    got, want = one.take(), each.take()
    assert [(r.sid, r.context, r.pos, r.end) for r in got] == \
        [(r.sid, r.context, r.pos, r.end) for r in want]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(torch.cat(g.rows), torch.cat(w.rows))
    # by value: context 1 took row 1 of steps 0-2, then rows 1-3 of step 3 (3 rows); context 2
    # the step's last row
    by = {r.context: torch.cat(r.rows)[:, 0].tolist() for r in got}
    assert by == {0: [0.0, 10.0, 20.0, 30.0], 1: [1.0, 11.0, 21.0, 31.0, 32.0, 33.0],
                  2: [2.0, 12.0, 22.0, 34.0]}
    with pytest.raises(ValueError, match="segments of 2 rows for 3"):
        one.add_step(9, [(0, 20, 2)], [torch.zeros(3, 1), torch.zeros(3, 1)])


def test_rows_taken_stay_as_they_were_when_more_are_parked():
    """Rows taken (on their way to the draft: a zmq frame of a CPU tensor is read after its
    send returns) are not overwritten by the rows parked after; a step's rows that do not fit
    are refused by name (the shard sends what is parked first: `room`); after `clear` (a new
    draft link) rows of another width park."""
    parked = ParkedRows()
    parked.add(1, 0, 0, _parts(1))
    parked.add(2, 0, 1, _parts(2))
    taken = parked.take()
    parked.add(3, 0, 2, _parts(3))
    assert torch.equal(taken[0].rows[0], _rows(1, 2))
    assert parked.room(parked.capacity - 1) and not parked.room(parked.capacity)
    with pytest.raises(ValueError, match="exceed"):
        parked.add(4, 1, 0, [torch.zeros(parked.capacity, 2)])
    parked.clear()  # (a new draft link: its rows may be of another width)
    parked.add(5, 0, 0, [torch.ones(1, 3), torch.ones(1, 2)])
    assert [tuple(r.rows[0].shape) for r in parked.take()] == [(1, 5)]


def test_a_shard_parks_rows_up_to_its_bytes_then_it_is_full():
    """Thousands of rows of a small model (a request that never speculates sends its rows
    once), fewer of a wide one, never under PARK_ROWS; `full` once that many are parked."""
    assert park_capacity(4 * 576 * 2) == PARK_BYTES // (4 * 576 * 2) > 7000  # (the default
    # model's one shard: 4 tapped layers, bf16)
    assert park_capacity(8) == PARK_ROWS_MAX and park_capacity(1 << 20) == PARK_ROWS
    parked = ParkedRows()
    wide = torch.zeros(1, PARK_BYTES // 1000 // 4)  # (float32: ~1,000 rows)
    for i in range(park_capacity(wide.shape[1] * 4)):
        assert not parked.full
        parked.add(i, 0, i, [wide])
    assert parked.full and parked.capacity == 1000 and len(parked.take()) == 1
    assert not parked.full


def test_feature_messages_hold_at_most_a_piece_and_the_last_says_so():
    parked = ParkedRows()
    for i in range(5):
        parked.add(20 + i, 3, 10 + i, _parts(i))
    parked.add(25, 1, 0, _parts(9))
    got = list(feature_messages(parked.take(), 2, [1, 4], last=True))
    assert [(h["slot"], h["pos"], h["n"], h["sid"], h["last"]) for h, _ in got] == [
        (3, 10, 2, 24, False), (3, 12, 2, 24, False), (3, 14, 1, 24, False),
        (1, 0, 1, 25, True)]
    assert torch.equal(torch.cat([r for h, r in got[:3]]), _rows(0, 1, 2, 3, 4))
    assert got[0][0]["layers"] == [1, 4] and got[0][0]["type"] == "feat"
    parked.add(30, 0, 0, _parts(1))
    assert [h["last"] for h, _ in feature_messages(parked.take(), 2, [1], last=False)] == [False]


# ---- through a real runtime: 2 CPU shards that both feed a random DFlash draft ----------------

G = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def coord(target, tmp_path_factory):
    draft = write_random_dflash(read_hf_config(target), tmp_path_factory.mktemp("draft"),
                                layers=1, taps=[1, 4], block_size=4)
    cfg = RuntimeConfig(model=str(target), devices=("cpu",) * 2, prefill_chunk=16,
                        max_context=256, threads=1, draft=str(draft))
    with Coordinator(cfg) as c:
        yield c


def _step(coord, token: int, pos: int, park: bool, wait: bool = True) -> int:
    """A decode step of slot 0 (draft context 0) at `pos`, parked or not (`wait`: for its
    result; else not even its slot's block table grows to hold it)."""
    if wait:
        coord.batcher.sched.hold_slot(0, pos + 1, new=pos == 0)
    sid = coord.send_step([(0, StepRequest([token], pos, G, 1, False), 0)], park=park)
    if wait:
        coord._wait(lambda s, m: False, time.monotonic() + 60, f"step {sid}", sid,
                    until=lambda: sid in coord._done, step=sid)
        coord.step_outputs(sid)
    return sid


def _draft_rows(coord, a: int, b: int, sync: int) -> np.ndarray:
    r = coord.draft_request(message("draft_features", slot=0, start=a, end=b, sync=sync))
    return np.frombuffer(r["_frames"][0].buffer, dtype=np.float32).reshape(b - a, -1).copy()


@pytest.mark.slow
@pytest.mark.parametrize("next_pos", [6, 7])
def test_rows_parked_for_a_sequence_stay_out_of_the_next_one_in_its_context(coord, next_pos):
    """A sequence ends with rows parked (positions 4, 5 of context 0); the next one in that
    context starts with a parked step at 6 (an exact repeat restored from the cache: its
    positions go on where the last ended) or 7: the rows of the one before go out at its
    start (`new_context`), and never into the new sequence's positions."""
    coord.forward([5, 6, 7, 8], 0, G, 1)
    _step(coord, 9, 4, True)
    _step(coord, 10, 5, True)
    assert coord.parked(0)
    coord.new_context(0)
    assert not coord.parked(0)
    coord.draft_request(message("draft_begin", slot=0, sample=None))
    before = _draft_rows(coord, 4, 6, 0)
    _step(coord, 11, next_pos, True)
    coord.unpark()
    assert np.array_equal(_draft_rows(coord, 4, 6, coord.feat_sid(0)), before)


@pytest.mark.slow
def test_rows_count_as_parked_until_a_step_that_is_not_parked_is_back(coord):
    """The coordinator counts rows as parked (a round of their context then runs a plain step
    first) until the result of a step that is not parked comes back, which every shard ran
    after sending them: not when such a step is only sent, and not when it is refused on its
    way (the shards after the one that refused it never sent theirs)."""
    coord.new_context(0)
    coord.draft_request(message("draft_begin", slot=0, sample=None))
    coord.forward([5, 6, 7, 8], 0, G, 1)
    parked = _step(coord, 9, 4, True)
    sid = _step(coord, 3, 250, False, wait=False)  # (outside the slot's blocks: refused)
    assert coord.parked(0)
    with pytest.raises(ShardFailure, match="outside the slot's block table"):
        coord._wait(lambda s, m: False, time.monotonic() + 30, f"step {sid}", sid,
                    until=lambda: sid in coord._done, step=sid)
        coord.step_outputs(sid)
    assert coord.parked(0)
    _step(coord, 10, 5, False)
    assert not coord.parked(0)
    t0 = time.monotonic()
    assert _draft_rows(coord, 0, 6, parked).shape[0] == 6
    assert time.monotonic() - t0 < 5  # (not the draft's wait for rows that never come)


@pytest.mark.slow
def test_an_unpark_keeps_counting_parked_steps_still_on_their_way(coord):
    """`unpark` sends what the shards park now; a parked step still on its way parks its rows
    after it, so its context stays counted as parked."""
    coord.new_context(0)
    coord.draft_request(message("draft_begin", slot=0, sample=None))
    coord.forward([5, 6, 7, 8], 0, G, 1)
    coord.batcher.sched.hold_slot(0, 5, new=False)
    sid = coord.send_step([(0, StepRequest([9], 4, G, 1, False), 0)], park=True)
    on_its_way = sid in coord._in_flight
    coord.unpark()
    assert coord.parked(0) or not on_its_way
    coord._wait(lambda s, m: False, time.monotonic() + 60, f"step {sid}", sid,
                until=lambda: sid in coord._done, step=sid)
    coord.step_outputs(sid)
    _step(coord, 10, 5, False)
    assert not coord.parked(0)


def test_a_shard_parks_a_whole_batched_group_as_the_graph_gave_it(monkeypatch):
    """`StepRunner._park_features`: when every segment of a batched decode step feeds the draft
    (`GroupTaps` of one group, in its order), the group's rows themselves are parked by one
    `add_step`; part of a group, or its segments out of order, go the way of separate rows
    (`adjacent`, or a copy each), into the same runs and rows."""
    rows = {1: torch.arange(12.0).reshape(3, 4), 5: -torch.arange(12.0).reshape(3, 4)}
    seen = []
    add_step = ParkedRows.add_step
    monkeypatch.setattr(ParkedRows, "add_step",
                        lambda self, sid, segs, parts: seen.append(parts) or
                        add_step(self, sid, segs, parts))

    def park(order: list[int]) -> tuple[list, list]:
        runner = SimpleNamespace(feed=object(), taps=(1, 5), parked=ParkedRows(),
                                 _send_parked=lambda last: None)
        fed = [Segment(j, 10 + j, 1, taps=GroupTaps(rows, j), feed=j) for j in order]
        seen.clear()
        StepRunner._park_features(runner, 7, fed)
        return list(seen), runner.parked.take()

    whole = torch.cat([rows[1], rows[5]], -1)
    parts, runs = park([0, 1, 2])
    assert len(parts) == 1 and parts[0][0] is rows[1] and parts[0][1] is rows[5]
    assert [(r.context, r.pos, r.end) for r in runs] == [(0, 10, 11), (1, 11, 12), (2, 12, 13)]
    for r in runs:
        assert torch.equal(torch.cat(r.rows), whole[r.context:r.context + 1])
    for order in ([0, 1], [1, 2], [2, 0, 1]):
        parts, runs = park(order)
        assert not any(p[0] is rows[1] for p in parts)  # (not the group's rows whole)
        assert sorted((r.context, r.pos, r.end) for r in runs) == \
            [(j, 10 + j, 11 + j) for j in sorted(order)]
        for r in runs:
            assert torch.equal(torch.cat(r.rows), whole[r.context:r.context + 1])
