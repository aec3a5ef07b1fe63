"""The draft process's feature channel: a malformed frame in a feeder's shared-memory ring is
consumed and refused, the frames after it are read from their start (no desync), and the
sequence whose context it broke gets no proposals until the next one begins."""

from __future__ import annotations

import pytest
import torch
from layersplit.draft.dflash import write_random_dflash
from layersplit.draft.server import DraftServer, DraftSpec
from layersplit.ipc.messages import ProtocolError, message
from layersplit.ipc.transport import accept, host_id
from layersplit.shards.model_config import read_hf_config


@pytest.fixture()
def server(tiny_llama, tmp_path):
    draft = write_random_dflash(read_hf_config(tiny_llama), tmp_path / "d", layers=1,
                                taps=[1, 4], block_size=4)
    s = DraftServer(DraftSpec(listen=f"ipc://{tmp_path}/draft.sock", draft=str(draft),
                              target=str(tiny_llama), max_context=64), b"secret")
    s._on_draft_configure(b"coord", message(
        "draft_configure", session=b"s", max_context=64, max_rows=16, feeders=[[1], [4]],
        cache_dir=None, spin_ms=0, slots=2, push=True), [])
    yield s
    s.close()


def _feeder(server, route, layers):
    server._on_feed(route, message("feed", transport="shm", host=host_id(), device="cpu",
                                   dtype="float32", layers=layers, width=64, max_rows=16), [])
    f = next(f for f in server.feeders if list(f.layers) == layers)
    return accept("shm", {"ring": f.inbox.ring.describe()}, None), f


def _feat(sid, pos, n, layers, slot=0):
    return message("feat", sid=sid, slot=slot, pos=pos, n=n, layers=layers, last=True, act=None)


def _verdict(sid, nxt, slot=0):
    return message("verdict", sid=sid, slot=slot, next=nxt)


def _rows(n):
    return torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 64)  # row i holds i


def test_a_verdict_prepares_the_next_proposal(server):
    """The last feeder's verdict names the next proposal: the draft computes it once every
    feeder's rows of that step are in, and the request finds it ready. A request for another
    one is computed afresh, without moving the kept rows' features a second time."""
    sent = []
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    first, _ = _feeder(server, b"shard0", [1])
    second, f2 = _feeder(server, b"shard1", [4])
    server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=0, sample=None), [])
    # a verify step at 3 of 6 rows kept rows 2 and 3 of its tree: the next proposal is at 6
    nxt = {"pos": 6, "token": 5, "kept": [2, 3], "n": 3, "tree": 0}
    second.send(_feat(2, 0, 9, [4]), _rows(9))
    second.send(_verdict(2, nxt), None)
    server._work()
    assert server.prepared.pending and not server.prepared.ready  # shard 0's rows not here yet
    first.send(_feat(2, 0, 9, [1]), _rows(9))
    server._work()
    assert 0 in server.prepared.ready
    feats = server.proposer.features[0, 0, :, 0].tolist()
    assert feats[3:7] == [3.0, 5.0, 6.0, 6.0]  # rows 5 and 6 moved to 4 and 5, once
    ask = {"sid": 3, "slot": 0, "pos": 6, "n": 3, "start": 0, "sync": 2, "tree": 0,
           "kept": [2, 3]}
    # a request for another token: computed afresh, the rows not moved a second time
    server._on_propose(b"coord", message("propose", token=7, **ask), [])
    assert "prepared" not in sent[-1] and len(sent[-1]["tokens"]) == 3
    assert server.proposer.features[0, 0, 3:7, 0].tolist() == [3.0, 5.0, 6.0, 6.0]
    # the same verify step again: the request that matches finds its proposal ready
    second.send(_feat(4, 0, 9, [4]), _rows(9))
    second.send(_verdict(4, nxt), None)
    first.send(_feat(4, 0, 9, [1]), _rows(9))
    server._work()
    server._on_propose(b"coord", message("propose", token=5, **{**ask, "sync": 4}), [])
    assert sent[-1]["type"] == "proposal" and sent[-1]["prepared"] is True
    assert server.proposer.features[0, 0, 3:7, 0].tolist() == [3.0, 5.0, 6.0, 6.0]
    assert sent[-1]["tokens"] == server.proposer.propose(0, 5, 6, 3)[0]  # as if asked now
    # a verdict the draft cannot use is refused by name to the coordinator, the context
    # stays whole
    server.coordinator = b"coord"
    second.send(_feat(5, 7, 1, [4]), _rows(1))
    second.send(_verdict(5, {"pos": -1}), None)
    second.send(_verdict(5, nxt, slot=7), None)
    first.send(_feat(5, 7, 1, [1]), _rows(1))
    server._work()
    assert not server.prepared.pending and not f2.rejected
    refused = [m["message"] for m in sent if m["type"] == "error"]
    assert [m["code"] for m in sent if m["type"] == "error"] == ["bad_verdict"] * 2
    assert "verdict of step 5" in refused[0] and "pos, token, n and tree" in refused[0]
    assert "slot 7 outside 0..1" in refused[1]
    server._wait_features(5, 0)
    # the next sequence begins before the last rows of the one before arrive (they travel on
    # another channel than the coordinator's messages): they are not stored, their verdict is
    # not prepared
    server._on_draft_begin(b"coord", message("draft_begin", sid=9, slot=0, sample=None), [])
    second.send(_feat(8, 0, 9, [4]), _rows(9) + 100)
    second.send(_verdict(8, nxt), None)
    first.send(_feat(8, 0, 9, [1]), _rows(9) + 100)
    server._work()
    assert not server.prepared.pending and not server.prepared.ready
    assert server.proposer.features[0, 0, 0, 0].item() == 0.0
    server._wait_features(8, 0)  # the feeders' progress still counts


def test_a_pushed_verdict_hands_its_proposal_to_the_first_shard(server):
    """A verdict whose proposal goes to the first shard (`push`): the draft sends it to the
    first feeder once every feeder's rows are in (`drafted`, under the verdict's key and
    step), the proposal a request would get; one it cannot prepare, with why."""
    sent = []
    server._reply = lambda route, msg, frames=(): sent.append((route, msg))
    first, _ = _feeder(server, b"shard0", [1])
    second, f2 = _feeder(server, b"shard1", [4])
    server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=0, sample=None), [])
    sent.clear()
    nxt = {"pos": 6, "token": 5, "kept": [2, 3], "n": 3, "tree": 0, "push": True}
    second.send(_feat(2, 0, 9, [4]), _rows(9))
    second.send(_verdict(2, nxt), None)
    server._work()
    assert not sent  # the first shard's rows are not here yet
    first.send(_feat(2, 0, 9, [1]), _rows(9))
    server._work()
    (route, msg), = sent
    assert route == b"shard0" and msg["type"] == "drafted"
    assert msg["feat"] == 0 and msg["after"] == 2 and msg["key"] == [6, 5, 3, 0, [2, 3]]
    assert msg["error"] is None and msg["parents"] is None
    assert msg["tokens"] == server.proposer.propose(0, 5, 6, 3)[0]
    assert not server.prepared.ready  # handed over, not kept for a request
    # a broken context: no proposal, and the first shard is told why at once
    f2.rejected[0] = "a bad frame"
    second.send(_feat(3, 0, 9, [4]), _rows(9))
    second.send(_verdict(3, {**nxt, "kept": None}), None)
    first.send(_feat(3, 0, 9, [1]), _rows(9))
    server._work()
    route, msg = sent[-1]
    assert route == b"shard0" and msg["tokens"] is None and "a bad frame" in msg["error"]


def test_push_without_feeders_is_refused(server):
    with pytest.raises(ProtocolError, match="push needs the first shard among the feeders"):
        server._on_draft_configure(b"coord", message(
            "draft_configure", session=b"s", max_context=64, max_rows=16, feeders=[],
            cache_dir=None, spin_ms=0, slots=2, push=True), [])


def test_proposals_go_through_the_first_shards_ring(server):
    """A first shard that offers a shared-memory ring for its proposals gets them there, not
    over zmq; a ring that cannot be mapped is refused by name."""
    from layersplit.ipc.transport import offer

    sent = []
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    inbox, desc = offer("shm", 64, torch.device("cpu"))
    try:
        with pytest.raises(ProtocolError, match="cannot map the proposals ring"):
            server._on_feed(b"shard0", message(
                "feed", transport="shm", host=host_id(), device="cpu", dtype="float32",
                layers=[1], width=64, max_rows=16, proposals={"ring": {"name": "nope"}}), [])
        server._on_feed(b"shard0", message(
            "feed", transport="shm", host=host_id(), device="cpu", dtype="float32", layers=[1],
            width=64, max_rows=16, proposals=desc), [])
        f1 = next(f for f in server.feeders if list(f.layers) == [1])
        first = accept("shm", {"ring": f1.inbox.ring.describe()}, None)
        second, _ = _feeder(server, b"shard1", [4])
        server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=0, sample=None), [])
        sent.clear()
        nxt = {"pos": 6, "token": 5, "kept": None, "n": 3, "tree": 0, "push": True}
        second.send(_feat(2, 0, 9, [4]), _rows(9))
        second.send(_verdict(2, nxt), None)
        first.send(_feat(2, 0, 9, [1]), _rows(9))
        server._work()
        assert not [m for m in sent if m["type"] == "drafted"]  # not over zmq
        msg, _, seq = inbox.poll()
        inbox.release(seq)
        assert msg["type"] == "drafted" and msg["after"] == 2 and msg["key"][:2] == [6, 5]
        assert msg["tokens"] == server.proposer.propose(0, 5, 6, 3)[0]
    finally:
        inbox.close()


def test_bad_frames_are_refused_without_desync(server):
    first, f1 = _feeder(server, b"shard0", [1])
    second, f2 = _feeder(server, b"shard1", [4])
    first.send(_feat(1, 0, 2, [1]), torch.zeros(3, 64))  # 3 rows said to be 2
    first.ring.write_header(first.ring.wait_free(first.seq), b"\xc1 not msgpack")  # garbage
    first.ring.publish(first.seq)
    first.seq += 1
    first.send(_feat(1, 0, 2, [4]), torch.ones(2, 64))  # the other feeder's layers
    first.send(_feat(2, 0, 2, [1]), torch.full((2, 64), 7.0))  # a good frame after them
    second.send(_feat(2, 0, 2, [4]), torch.full((2, 64), 9.0))
    second.send(_feat(2, 0, 1, [4], slot=1), torch.full((1, 64), 5.0))  # another sequence's
    server._drain_inboxes()
    feats = server.proposer.features[0, 0]
    assert torch.equal(feats[:2, :64], torch.full((2, 64), 7.0))  # read from its start
    assert torch.equal(feats[:2, 64:], torch.full((2, 64), 9.0))
    assert torch.equal(server.proposer.features[0, 1, :1, 64:], torch.full((1, 64), 5.0))
    assert f1.fed_sid == 2 and f2.fed_sid == 2
    # the unreadable frame may have been any sequence's: every slot's context is incomplete
    assert set(f1.rejected) == {0, 1} and not f2.rejected
    with pytest.raises(ProtocolError, match="incomplete"):  # no proposal from a broken context
        server._wait_features(2, 0)
    server._on_draft_begin(b"coord", message("draft_begin", sid=3, slot=0, sample=None), [])
    server._wait_features(2, 0)  # a new sequence starts whole
    with pytest.raises(ProtocolError, match="incomplete"):  # the other slot's still is not
        server._wait_features(2, 1)
    assert len(server.proposer.propose(0, 5, 2, 3)[0]) == 3


def test_draft_contexts_out_of_range_are_refused(server):
    """The draft keeps `slots` contexts (2 here): a feature frame, a new sequence or a proposal
    for another one is refused by name. The frame's rows could have been any sequence's, so
    every context is incomplete until its next sequence begins."""
    first, f1 = _feeder(server, b"shard0", [1])
    first.send(_feat(1, 0, 2, [1], slot=2), torch.zeros(2, 64))
    server._drain_inboxes()
    assert set(f1.rejected) == {0, 1} and "slot 2 outside 0..1" in f1.rejected[0]
    with pytest.raises(ProtocolError, match="incomplete"):
        server._wait_features(0, 0)
    server._on_draft_begin(b"coord", message("draft_begin", sid=3, slot=0, sample=None), [])
    server._wait_features(0, 0)
    with pytest.raises(ProtocolError, match="draft_begin: slot 2 outside 0..1"):
        server._on_draft_begin(b"coord", message("draft_begin", sid=4, slot=2, sample=None), [])
    with pytest.raises(ProtocolError, match="slot 5 outside 0..1"):
        server._on_propose(b"coord", message("propose", sid=5, slot=5, pos=2, n=3, token=1,
                                              start=0, sync=0, tree=0, kept=None), [])
    # a tree size or kept rows that cannot be: refused by name, nothing moved
    before = server.proposer.features.clone()
    with pytest.raises(ProtocolError, match="propose: tree -1 is negative"):
        server._on_propose(b"coord", message("propose", sid=6, slot=0, pos=2, n=3, token=1,
                                              start=0, sync=0, tree=-1, kept=None), [])
    with pytest.raises(ProtocolError, match=r"propose: kept tree rows \[2, 1\] before position 9"):
        server._on_propose(b"coord", message("propose", sid=7, slot=0, pos=9, n=3, token=1,
                                              start=0, sync=0, tree=0, kept=[2, 1]), [])
    with pytest.raises(ProtocolError, match="kept rows .* outside the context of 64"):
        server._on_propose(b"coord", message("propose", sid=8, slot=0, pos=60, n=3, token=1,
                                              start=0, sync=0, tree=0, kept=[9]), [])
    assert torch.equal(server.proposer.features, before)
    with pytest.raises(ProtocolError, match="slot 3 of 0..1|outside"):
        server._on_draft_features(b"coord", message("draft_features", sid=6, slot=3, start=0,
                                                      end=2, sync=0), [])


def test_a_linked_feeder_cannot_be_taken_over(server):
    _feeder(server, b"shard0", [1])
    with pytest.raises(ProtocolError, match="linked already"):
        _feeder(server, b"intruder", [1])
    with pytest.raises(ProtocolError, match="not a configured feeder"):
        _feeder(server, b"intruder", [2])



def test_a_verdict_after_its_request_is_dropped(server):
    """The last shard sends a step's rows, then the result, then the verdict: a request served
    in between computed its proposal and moved the kept rows' features itself, so the late
    verdict prepares nothing and moves nothing a second time."""
    sent = []
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    first, _ = _feeder(server, b"shard0", [1])
    second, _ = _feeder(server, b"shard1", [4])
    server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=0, sample=None), [])
    first.send(_feat(2, 0, 9, [1]), _rows(9))
    second.send(_feat(2, 0, 9, [4]), _rows(9))
    server._work()
    server._on_propose(b"coord", message("propose", sid=3, slot=0, pos=6, n=3, token=5, start=0,
                                          sync=2, tree=0, kept=[2, 3]), [])
    assert sent[-1]["type"] == "proposal" and len(sent[-1]["tokens"]) == 3
    moved = server.proposer.features.clone()
    assert moved[0, 0, 3:7, 0].tolist() == [3.0, 5.0, 6.0, 6.0]  # rows 5 and 6 moved once
    second.send(_verdict(2, {"pos": 6, "token": 5, "kept": [2, 3], "n": 3, "tree": 0}), None)
    server._work()
    assert not server.prepared.pending and not server.prepared.ready
    assert torch.equal(server.proposer.features, moved)
    # the next step's verdict (a later step than the request needed) is prepared as before
    first.send(_feat(4, 9, 1, [1]), _rows(1))
    second.send(_feat(4, 9, 1, [4]), _rows(1))
    second.send(_verdict(4, {"pos": 10, "token": 5, "kept": None, "n": 3, "tree": 0}), None)
    server._work()
    assert 0 in server.prepared.ready


def test_verdicts_over_zmq_come_only_from_zmq_feeders(server):
    """A verdict on the router is a zmq feeder's: from any other peer, or from a feeder whose
    messages come through a ring, it is refused by name and nothing is prepared."""
    _feeder(server, b"shard1", [4])  # a ring feeder
    nxt = {"pos": 6, "token": 5, "kept": None, "n": 3, "tree": 0}
    for route in (b"intruder", b"shard1"):
        with pytest.raises(ProtocolError, match="verdict from a peer that is not a zmq feeder"):
            server._on_verdict(route, _verdict(2, nxt))
    assert not server.prepared.pending


def test_sampled_proposals_carry_their_distributions(server):
    """A sequence that samples (`draft_begin`'s `sample`) gets proposals drawn from the draft's
    distribution, sent with it (`q`, valid for its tokens); one prepared from a verdict equals
    the one computed when asked (the same seeded draws). Bad sampling is refused by name."""
    from layersplit.shards.spec_tree import check_q

    sent = []
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    first, _ = _feeder(server, b"shard0", [1])
    second, _ = _feeder(server, b"shard1", [4])
    sample = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 3, "mode": "rejection"}
    server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=0, sample=sample), [])
    nxt = {"pos": 6, "token": 5, "kept": None, "n": 3, "tree": 0}
    for f, layers in ((first, [1]), (second, [4])):
        f.send(_feat(2, 0, 9, layers), torch.randn(9, 64))
    second.send(_verdict(2, nxt), None)
    server._work()
    assert 0 in server.prepared.ready
    ask = {"sid": 3, "slot": 0, "pos": 6, "n": 3, "start": 0, "sync": 2, "tree": 0,
           "kept": None}
    server._on_propose(b"coord", message("propose", token=5, **ask), [])
    prepared = sent[-1]
    assert prepared["prepared"] is True and prepared["q"] is not None
    check_q(prepared["q"], prepared["tokens"], prepared["parents"],
            server.proposer.head.shape[0])
    assert server.proposer.propose(0, 5, 6, 3) == (prepared["tokens"], None, prepared["q"])
    # the best guesses for a greedy sequence, coupled draws: no q
    server._on_draft_begin(b"coord", message("draft_begin", sid=4, slot=1, sample=None), [])
    assert server.proposer.propose(1, 5, 6, 3)[2] is None
    coupled = {**sample, "mode": "coupled"}
    server._on_draft_begin(b"coord", message("draft_begin", sid=4, slot=1, sample=coupled), [])
    assert server.proposer.propose(1, 5, 6, 3)[2] is None
    for bad, why in (({**sample, "temperature": 0}, "temperature must be a number > 0"),
                     ({**sample, "top_p": 2.0}, "top_p must be in"),
                     ({**sample, "seed": "x"}, "seed must be an integer"),
                     ({**sample, "mode": "greedy"}, "mode must be coupled or rejection")):
        with pytest.raises(ProtocolError, match=f"draft_begin: sample .*{why}"):
            server._on_draft_begin(b"coord", message("draft_begin", sid=5, slot=0, sample=bad),
                                   [])


def test_the_warm_up_waits_for_every_feeder_link(server, monkeypatch):
    """`draft_configure` answers before the proposer's warm-up (compile, capture): that runs
    once every feeder has linked, so the shards warm up meanwhile, and `draft_warm` answers
    after it (with its failure, if it failed); a message that touches a sequence's rows before
    then runs it first."""
    calls, sent = [], []
    warm, begin = server.proposer.warm_up, server.proposer.begin
    monkeypatch.setattr(server.proposer, "warm_up", lambda: calls.append("warm") or warm())
    monkeypatch.setattr(server.proposer, "begin",
                        lambda slot, sample=None: calls.append(("begin", slot)) or
                        begin(slot, sample))
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    assert server.warm_pending
    server._work()
    _feeder(server, b"shard0", [1])
    server._work()
    assert calls == []  # shard 1 has not linked
    _feeder(server, b"shard1", [4])
    assert calls == []
    server._work()
    server._work()
    assert calls == ["warm"] and not server.warm_pending
    server._on_draft_warm(b"coord", message("draft_warm", sid=5), [])
    assert calls == ["warm"] and sent[-1]["type"] == "ok" and sent[-1]["sid"] == 5
    # configured again: a sequence's message before the links warms first, then runs
    server._on_draft_configure(b"coord", message(
        "draft_configure", session=b"s", max_context=64, max_rows=16, feeders=[[1], [4]],
        cache_dir=None, spin_ms=0, slots=2, push=True), [])
    monkeypatch.setattr(server.gate, "screen", lambda route, msg, reply: True)
    server._dispatch(b"coord", message("draft_begin", sid=1, slot=0, sample=None), [])
    assert calls == ["warm", "warm", ("begin", 0)] and not server.warm_pending
    # a failed warm-up: draft_warm answers with it
    server._on_draft_configure(b"coord", message(
        "draft_configure", session=b"s", max_context=64, max_rows=16, feeders=[[1], [4]],
        cache_dir=None, spin_ms=0, slots=2, push=True), [])

    def broken() -> None:
        raise RuntimeError("capture failed")

    monkeypatch.setattr(server.proposer, "warm_up", broken)
    server._dispatch(b"coord", message("draft_warm", sid=6), [])
    assert sent[-1]["type"] == "error" and "capture failed" in sent[-1]["message"]


def test_draft_gap_masks_the_rows_that_never_came_and_refuses_rows_outside_the_context(
        server):
    """`draft_gap` (a sequence's plain steps sent no rows for a while) marks those rows unread
    by its proposals; a slot or rows outside the draft's are refused by name, and the context
    stays as it was; a new sequence in the slot reads every row."""
    sent = []
    server._reply = lambda route, msg, frames=(): sent.append(msg)
    known = server.proposer.known
    server._on_draft_begin(b"coord", message("draft_begin", sid=1, slot=1, sample=None), [])
    server._on_draft_gap(b"coord", message("draft_gap", sid=2, slot=1, start=4, end=9), [])
    assert sent[-1]["type"] == "ok"
    want = [not 4 <= p < 9 for p in range(known.shape[1])]
    assert known[1].tolist() == want and known[0].all()
    for slot, a, b in ((2, 4, 9), (1, 9, 9), (1, 60, 65), (1, -1, 3)):
        with pytest.raises(ProtocolError, match="draft_gap: gap"):
            server._on_draft_gap(b"coord", message("draft_gap", sid=3, slot=slot, start=a,
                                                   end=b), [])
    assert known[1].tolist() == want
    server._on_draft_begin(b"coord", message("draft_begin", sid=4, slot=1, sample=None), [])
    assert known[1].all()
