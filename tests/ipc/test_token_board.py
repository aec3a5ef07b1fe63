"""The token board of decode lookahead (`ipc.token_board`): the last shard posts each slot's
sampled token, the first takes it, in another process, through shared memory that is private
to the user and gone once both ends mapped it; a step waits while the token may still come and
no longer once it cannot (the last shard passed the step, or the step was voided); a bad
description is refused by name."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from layersplit.ipc.messages import ProtocolError
from layersplit.ipc.token_board import TokenBoard

from tests.helpers import layersplit_shm

CPU = torch.device("cpu")
READER = r"""
import json, sys, time, torch
from layersplit.ipc.token_board import TokenBoard
desc = json.loads(sys.argv[1])
if "BOARD_HEX" in __import__("os").environ:  # (bytes in the description, as hex in JSON)
    desc["event"] = bytes.fromhex(desc["event"])
    desc["cuda"] = {k: bytes.fromhex(v) if k.endswith("handle") and v else v
                    for k, v in desc["cuda"].items()}
board = TokenBoard.attach(desc, 4, torch.device("cpu"))
seqs = [{"slot": 2, "n": 1, "prev": 7}, {"slot": 0, "n": 1, "prev": None}]
deadline = time.monotonic() + 30
print("attached", flush=True)
while board.waits(seqs, 8) and time.monotonic() < deadline:
    time.sleep(0.001)
x = torch.tensor([0, 11], device=board.device)
print(json.dumps({"error": board.error(2, 7, 1), "x": board.fill(x, seqs).tolist()}), flush=True)
"""


@pytest.mark.slow
def test_a_token_posted_in_one_process_is_taken_in_another():
    before = layersplit_shm()
    writer, desc = TokenBoard.create(4, CPU)
    try:
        (name,) = layersplit_shm() - before
        assert stat.S_IMODE(os.stat(Path("/dev/shm") / name).st_mode) == 0o600
        child = subprocess.Popen([sys.executable, "-c", READER, json.dumps(desc)],
                                 stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[2])
        assert child.stdout.readline().strip() == "attached"
        assert layersplit_shm() - before == set()  # (unlinked once both ends hold it)
        writer.post([1, 2], torch.tensor([5, 42]), 7)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        assert json.loads(out) == {"error": None, "x": [42, 11]}
    finally:
        writer.close()
    assert layersplit_shm() - before == set()


def test_a_step_waits_while_its_token_may_come_and_then_says_why():
    writer, desc = TokenBoard.create(3, CPU)
    reader = TokenBoard.attach(desc, 3, CPU)
    try:
        seg = {"slot": 1, "n": 1, "prev": 5}
        assert reader.waits([seg], 6)
        assert not reader.waits([seg], 5)  # (not an earlier step: refused, never waited for)
        writer.post([0], torch.tensor([9]), 4)  # another slot's step: still waits
        assert reader.waits([seg], 6)
        writer.post([1], torch.tensor([3]), 5)
        assert not reader.waits([seg], 6) and reader.error(1, 5, 1) is None
        assert reader.fill(torch.tensor([0]), [seg]).tolist() == [3]
        assert reader.error(1, 5, 2) == "prev=5 on a segment of 2 rows (a lookahead step " \
            "decodes one row)"
        # a step the last shard is done with that sampled nothing for the slot
        seg2 = {"slot": 2, "n": 1, "prev": 8}
        assert reader.waits([seg2], 9)
        writer.passed(8)
        assert not reader.waits([seg2], 9)
        assert reader.error(2, 8, 1) == "prev=8, but slot 2's last sampled token came from " \
            "step -1 (step 8 did not sample it)"
        # a step that failed on its way (the coordinator's `void`)
        seg3 = {"slot": 2, "n": 1, "prev": 12}
        assert reader.waits([seg3], 13)
        reader.void(12)
        assert not reader.waits([seg3], 13)
        assert reader.error(2, 12, 1).endswith("(step 12 failed)")
        writer.post([1], torch.tensor([4]), 14)
        assert reader.error(1, 5, 1).endswith("(a later step sampled it since)")
    finally:
        reader.close()
        writer.close()


def test_a_board_on_another_host_is_not_mapped_and_a_bad_one_is_refused_by_name():
    writer, desc = TokenBoard.create(2, CPU)
    try:
        assert TokenBoard.attach({**desc, "host": "elsewhere"}, 2, CPU) is None
        with pytest.raises(ProtocolError, match="for 3 slots"):
            TokenBoard.attach(desc, 3, CPU)
        for bad in ("junk", {"host": desc["host"]}, {**desc, "device": 0}):
            with pytest.raises(ProtocolError, match="is not a token board's description"):
                TokenBoard.attach(bad, 2, CPU)
        with pytest.raises(ProtocolError, match="configure: board: shared-memory ring"):
            TokenBoard.attach({**desc, "ring": {**desc["ring"], "name": "other"}}, 2, CPU)
    finally:
        writer.close()


def test_a_sid_seen_before_its_token_waits_for_the_word_that_names_it(monkeypatch):
    """Host mode on a CPU that orders stores weakly (ARM): the reader may see a slot's new
    sid before the token the writer stored first. Each token word names its step
    (`token_board.pack`), so the reader waits for that word and never takes the slot's earlier
    token; a word that never shows fails the step by name."""
    from layersplit.ipc import token_board

    # (waits long enough for a timer thread on a loaded machine; each ends when its store shows)
    monkeypatch.setattr(token_board, "WORD_WAIT_S", 30.0)
    monkeypatch.setattr(token_board, "SID_SHOW_S", 30.0)
    writer, desc = TokenBoard.create(3, CPU)
    reader = TokenBoard.attach(desc, 3, CPU)
    try:
        writer.post([2], torch.tensor([99]), 3)  # the slot's earlier token
        seg = {"slot": 2, "n": 1, "prev": 7}
        writer.sid[2] = 7  # the sid shows first; the word still names step 3
        assert not reader.waits([seg], 8) and reader.error(2, 7, 1) is None
        late = threading.Timer(0.05, lambda: writer.host.__setitem__(2, token_board.pack(7, 42)))
        late.start()
        assert reader.fill(torch.tensor([0, 5]), [seg, {"slot": 0, "n": 1, "prev": None}]
                           ).tolist() == [42, 5]
        late.join()
        # the writer passed step 11 (its `done` word shows) before slot 0's sid 11 shows
        writer.host[0] = token_board.pack(11, 6)
        writer.mode[1] = 11
        show = threading.Timer(0.01, lambda: writer.sid.__setitem__(0, 11))
        show.start()
        assert reader.error(0, 11, 1) is None
        show.join()
        assert reader.fill(torch.tensor([0]), [{"slot": 0, "n": 1, "prev": 11}]).tolist() == [6]
        monkeypatch.setattr(token_board, "WORD_WAIT_S", 0.05)
        writer.sid[1] = 9
        with pytest.raises(ProtocolError, match="slot 1's token of step 9 did not show"):
            reader.fill(torch.tensor([0]), [{"slot": 1, "n": 1, "prev": 9}])
        assert token_board.pack(5, 7) >> token_board.TOKEN_BITS == 5
        for bad in ((1, 1 << token_board.TOKEN_BITS), (-1, 3)):
            with pytest.raises(ValueError, match="outside the host word"):
                token_board.pack(*bad)
    finally:
        reader.close()
        writer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mode_orders_the_readers_copy_after_the_writers_kernels():
    """Both ends on one GPU, in two processes: the token is written by a copy queued behind
    slow kernels, and the reader, once it sees the sid, takes it by a copy on its own stream
    that waits for the writer's (an IPC event), not for any host."""
    dev = torch.device("cuda:0")
    writer, desc = TokenBoard.create(4, dev)
    try:
        child = subprocess.Popen([sys.executable, "-c", READER.replace('"cpu"', '"cuda:0"'),
                                  json.dumps({**desc, "event": desc["event"].hex(), "cuda": {
                                      k: v.hex() if isinstance(v, bytes) else v
                                      for k, v in desc["cuda"].items()}})],
                                 stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[2],
                                 env={**os.environ, "BOARD_HEX": "1"})
        assert child.stdout.readline().strip() == "attached"
        big = torch.randn(4096, 4096, device=dev)
        for _ in range(50):  # (slow work ahead of the token on the writer's stream)
            big = torch.tanh(big @ big)
        writer.post([1, 2], (big[0, :2] * 0 + torch.tensor([5, 42], device=dev)).long(), 7)
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        assert json.loads(out) == {"error": None, "x": [42, 11]}
    finally:
        writer.close()
