"""The first shard's use of the proposals the draft hands it (`shards.asked`): a good one makes
the asking segment a verify segment; a missing, foreign or malformed one leaves it a decode
segment that says why, and a malformed `ask` or `drafted` is refused by name."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from layersplit.ipc.messages import ProtocolError, decode, encode, message, segment
from layersplit.shards.asked import asked, check_drafted, fill, ready

VOCAB = 100
SAMPLE = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 1}


def _step(kept=None):
    """A step of two segments: slot 0 decodes plainly, slot 1 asks for the draft's proposal
    (n 3, a tree of up to 4) made from the verdict of step 7."""
    segs = [segment(0, 10, 1, SAMPLE),
            segment(1, 20, 1, SAMPLE, feat=0, kept=kept, then={"n": 3, "tree": 4},
                    ask={"n": 3, "tree": 4, "after": 7})]
    return decode(encode(message("step", sid=9, seqs=segs, act=None)), 1), torch.tensor([5, 6])


def _drafted(tokens=(11, 12, 13, 14), parents=(0, 1, 2, 1), key=(20, 6, 3, 4, None), after=7,
             error=None):
    msg = message("drafted", feat=0, after=after, key=list(key),
                  tokens=None if tokens is None else list(tokens),
                  parents=None if parents is None else list(parents), q=None, error=error,
                  compute_s=0.25)
    return decode(encode(msg))


def test_a_proposal_makes_the_segment_a_verify_segment():
    msg, x = _step()
    d = _drafted()
    check_drafted(d)
    assert asked(msg) and not asked(_step()[0] | {"seqs": _step()[0]["seqs"][:1]})
    assert ready(msg, {0: d}) and not ready(msg, {}) and not ready(msg, {0: _drafted(after=6)})
    ids = fill(msg, x, {0: d}, "-", 0.5, VOCAB)
    assert ids.tolist() == [5, 6, 11, 12, 13, 14]
    plain, seg = msg["seqs"]
    assert plain["n"] == 1 and plain["asked"] is None
    assert seg["n"] == 5 and seg["draft"] == [11, 12, 13, 14] and seg["tree"] == [0, 1, 2, 1]
    assert seg["ask"] is None and seg["then"] == {"n": 3, "tree": 4}
    assert seg["asked"] == {"draft": [11, 12, 13, 14], "tree": [0, 1, 2, 1], "missed": None,
                            "waited": 0.5, "compute": 0.25}


@pytest.mark.parametrize("got,why", [
    (None, "the draft is gone"),
    (_drafted(after=6), "the draft is gone"),  # an older verdict's: the one asked for is late
    (_drafted(tokens=None, parents=None, error="boom"), "could not prepare it: boom"),
    (_drafted(key=(20, 7, 3, 4, None)), "not \\[20, 6, 3, 4, None\\]"),  # another token
    (_drafted(tokens=(1, 2, 3, 4), parents=None), "4 tokens in a row, not up to 3"),
    (_drafted(tokens=(1, 2, 3, 4, 5), parents=(0, 1, 2, 3, 4)), "a tree of 5 tokens"),
    (_drafted(tokens=(1, VOCAB), parents=(0, 1)), "not token ids of the vocabulary"),
    (_drafted(tokens=(1, True), parents=(0, 1)), "not token ids of the vocabulary"),
    (_drafted(tokens=(), parents=None), "no tokens"),
    (_drafted(parents=(0, 5, 1, 2)), "parent"),  # not a tree
    (_drafted(tokens=(1, 2), parents=(0, 1)), None),  # (a good one, for contrast)
])
def test_no_usable_proposal_leaves_a_decode_segment_that_says_why(got, why):
    msg, x = _step()
    ids = fill(msg, x, {} if got is None else {0: got}, "the draft is gone", 1.0, VOCAB)
    if why is None:
        assert ids.tolist() == [5, 6, 1, 2] and msg["seqs"][1]["asked"]["missed"] is None
        return
    assert ids.tolist() == [5, 6]
    seg = msg["seqs"][1]
    assert seg["n"] == 1 and seg["draft"] is None and seg["tree"] is None
    assert seg["ask"] is None and seg["then"] is None  # nothing for the draft to prepare
    assert seg["asked"]["draft"] is None
    assert pytest.approx(seg["asked"]["waited"]) == 1.0

    assert re.search(why, seg["asked"]["missed"]), seg["asked"]["missed"]


def test_the_kept_rows_are_part_of_the_key():
    msg, x = _step(kept=[1, 3])
    fill(msg, x, {0: _drafted()}, "-", 0.0, VOCAB)  # prepared without them: not this proposal
    assert msg["seqs"][1]["asked"]["missed"]
    msg, x = _step(kept=[1, 3])
    fill(msg, x, {0: _drafted(key=(20, 6, 3, 4, [1, 3]))}, "-", 0.0, VOCAB)
    assert msg["seqs"][1]["draft"] == [11, 12, 13, 14]


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(key=[1, 2, 3]), "not \\[pos, token, n, tree, kept\\]"),
    (lambda d: d.update(key=[1, 2, 3, True, None]), "not \\[pos, token, n, tree, kept\\]"),
    (lambda d: d.update(key=[1, 2, 3, 4, 5]), "not \\[pos, token, n, tree, kept\\]"),
    (lambda d: d.update(tokens=None, error=None), "neither tokens nor an error"),
])
def test_malformed_drafted_messages_are_refused_by_name(change, match):
    d = copy.deepcopy(_drafted())
    change(d)
    with pytest.raises(ProtocolError, match=match):
        check_drafted(d)


@pytest.mark.parametrize("change,match", [
    (lambda s: s.update(ask={"n": 3, "tree": 4}), "needs n, tree and after"),
    (lambda s: s.update(ask={"n": -1, "tree": 4, "after": 7}), "needs n, tree and after"),
    (lambda s: s.update(ask=[3, 4, 7]), "ask must be a map"),
    (lambda s: s.update(n=2), "one row with none of its own"),
    (lambda s: s.update(draft=[]), "one row with none of its own"),
    (lambda s: s.update(sample=None), "needs its sampling parameters"),
    (lambda s: s.update(feat=None), "needs the sequence's draft context"),
])
def test_a_malformed_ask_is_refused_by_name(change, match):
    """Before the step is held (`asked`), so it is refused, never waited on."""
    msg, _ = _step()
    change(msg["seqs"][1])
    with pytest.raises(ProtocolError, match=match):
        asked(msg)
