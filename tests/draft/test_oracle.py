"""The bench oracle (`draft.oracle`): the draft network runs, its proposals are the plain greedy
run's tokens with errors placed for a mean acceptance A; the output stays plain decoding's and
the measured acceptance is A. A normal run refuses to start while the oracle is set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from layersplit.draft.oracle_table import ORACLE_ENV, OracleTable, read_oracle, reread
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import oracle_acceptance

GREEDY = SamplingParams(max_tokens=96, ignore_eos=True)


def test_errors_are_placed_for_the_mean():
    """Rounds from the first proposal on commit 6 or 7 tokens, 6.3 on average; one cut short
    (the draft's block, a request's end) puts the next back on the lattice."""
    table = OracleTable(6.3, ((1, 2, 3),), seed=4)
    pos, rounds = 100, []
    while pos < 100 + 630:
        rounds.append(table.committed(100, pos, 16))
        pos += rounds[-1]
    assert set(rounds) == {6, 7} and sum(rounds) / len(rounds) == pytest.approx(6.3, abs=0.02)
    cut = table.committed(100, 100, 3)
    assert cut == 3 and table.committed(100, 103, 16) == rounds[0] - 3


def test_a_bad_table_is_named(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"acceptance": 0.5, "sequences": []}))
    with pytest.raises(ValueError, match="acceptance"):
        read_oracle(bad)


def test_the_table_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"acceptance": 2, "sequences": [[1, 2]]}))
    table = read_oracle(path)
    assert reread(table) is table
    path.write_text(json.dumps({"acceptance": 2, "sequences": [[1, 2], [3, 4, 5]]}))
    __import__("os").utime(path, ns=(table.stamp + 10**9, table.stamp + 10**9))
    assert reread(table).sequences == ((1, 2), (3, 4, 5))


def test_a_normal_run_refuses_the_oracle(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"acceptance": 2, "sequences": []}))
    env = {**__import__("os").environ, ORACLE_ENV: str(table)}
    r = subprocess.run([sys.executable, "-m", "layersplit.launch.cli", "generate", "hi",
                        "--model", "random:smollm2-135m-shape"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and ORACLE_ENV in r.stderr


@pytest.mark.slow
def test_oracle_keeps_plain_tokens_at_its_acceptance(target, dflash, tmp_path, monkeypatch):
    """Two prompts (the tiny target's output varies), chains of 3 draft tokens: A = 2.5 (2 or
    3 tokens a verify step) measured within 0.1, every token plain decoding's."""
    ref = ReferenceEngine(target, prefill_chunk=16, max_context=256)
    prompts = [list(range(3, 40)), [7, 9, 11, 13] * 6]
    plain = [ref.generate(p, GREEDY).tokens for p in prompts]
    assert all(len(set(t)) > 5 for t in plain)
    table = tmp_path / "oracle.json"
    table.write_text(json.dumps({"acceptance": 2.5, "seed": 1,
                                 "sequences": [p + t for p, t in zip(prompts, plain)]}))
    monkeypatch.setenv(ORACLE_ENV, str(table))
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=256, threads=1, draft=str(dflash))
    with Coordinator(cfg) as coord:
        assert coord.draft_info["bench_oracle"] == 2.5
        acceptance = oracle_acceptance(coord, prompts, plain, GREEDY)
    assert abs(acceptance - 2.5) <= 0.1, acceptance


def _proposer(table: OracleTable, slots: int = 1, vocab: int = 1000):
    """The oracle's proposer without its network: `_replace` given the draft's own tokens."""
    from types import SimpleNamespace

    from layersplit.draft.oracle import OracleProposer

    p = OracleProposer.__new__(OracleProposer)
    p.slots, p.sampling, p.done, p.holes = slots, [None] * slots, [0] * slots, [False] * slots
    p.cfg = SimpleNamespace(model=SimpleNamespace(vocab_size=vocab))
    p.set_oracle(table)
    return p


def _verify_run(p, target: list[int], start: int, block: int = 15) -> float:
    """Greedy speculation of `target` (what the target model outputs, from `start` on) with
    `p`'s proposals as a verify step judges them: the draft tokens equal to the target's kept,
    then the target's own; the tokens committed per verify step on average."""
    pos, verifies = start, 0
    while pos < len(target) - 1:
        n = min(block, len(target) - 1 - pos)
        drafted = p._replace(0, target[pos], pos, ([999] * n, None, None))[0]
        kept = next((j for j, t in enumerate(drafted) if t != target[pos + 1 + j]), n)
        pos += kept + 1
        verifies += 1
    return (len(target) - 1 - start) / verifies


def _chain(seed: int, n: int) -> list[int]:
    rng = __import__("random").Random(seed)
    return [rng.randrange(900) for _ in range(n)]


def test_a_sequence_off_the_plain_output_follows_the_latest_pass():
    """The target left the plain output at a near-tie (a kept draft token's position) and an
    earlier pass's output is the target's: every round commits on the lattice, none short."""
    plain = _chain(1, 300)
    spec = plain[:150] + [(plain[150] + 7) % 900] + _chain(2, 149)
    on_lattice = _verify_run(_proposer(OracleTable(6.3, (tuple(spec),), seed=1)), spec, 40)
    assert on_lattice == pytest.approx(6.3, abs=0.15)
    p = _proposer(OracleTable(6.3, (tuple(plain), tuple(spec)), seed=1))
    assert _verify_run(p, spec, 40) == on_lattice
    assert p.missed == 0


def test_a_sequence_that_left_the_table_is_found_again():
    """With several streams a batched verify step's rounding depends on the others' rows, so
    the target may leave every known output at a near-tie; where it comes back onto a known
    continuation (here: it loops), its proposals follow the table again instead of the
    draft's own tokens to the end."""
    loop = _chain(3, 12)
    plain = _chain(4, 60) + loop * 20
    target = plain[:50] + [(plain[50] + 1) % 900] + _chain(5, 10) + loop * 30
    p = _proposer(OracleTable(6.3, (tuple(plain),), seed=1))
    acceptance = _verify_run(p, target, 20)
    assert acceptance > 4, acceptance
    assert p.missed == 1 and p.reentered >= 1


def _batched_pass(p, starts: list[list[int]], new: int, tie: int | None) -> tuple[list, float]:
    """One pass of streams decoded together, each speculating with `p` (a slot each), against
    a toy target whose greedy token is a hash of the last tokens, except at near-ties (one
    context in 40) where it is the other of two tokens when the step has fewer rows than all
    streams' (a batched verify step's rounding: `tie` the plain run's, None for verify steps).
    Each stream's tokens and the tokens committed per verify step over all of them."""
    def target(ctx: list[int], rows: int | None) -> int:
        h = hash(tuple(ctx[-4:])) % 900
        if h % 40:
            return h
        return (h + (rows if rows is not None else 0)) % 900

    seqs = [list(s) for s in starts]
    ends = [len(s) + new for s in starts]
    committed = verifies = 0
    if tie is not None:  # plain decoding: one token a step
        for s in seqs:
            while len(s) < ends[seqs.index(s)]:
                s.append(target(s, tie))
        return seqs, 1.0
    for slot, s in enumerate(seqs):
        p.begin(slot)
    while any(len(s) < e for s, e in zip(seqs, ends)):
        alive = [i for i, (s, e) in enumerate(zip(seqs, ends)) if len(s) < e]
        rows = int(len(alive) < len(seqs))
        for i in alive:
            s, pos = seqs[i], len(seqs[i]) - 1
            n = min(15, ends[i] - len(s))
            drafted = p._replace(i, s[pos], pos, ([899] * n, None, None))[0]
            for d in drafted:  # the verify step: its rows in turn, the first miss ends it
                want = target(s, rows)
                s.append(want)
                committed += 1
                if d != want:
                    break
            else:
                if len(s) < ends[i]:
                    s.append(target(s, rows))
                    committed += 1
            verifies += 1
    return seqs, committed / verifies


def test_streams_whose_batched_steps_round_otherwise_reach_the_acceptance():
    """Eight streams whose verify steps round otherwise than plain decoding's and than each
    other's when fewer streams are left (a stream that leaves the table runs longer): untimed
    passes add their outputs until one adds none (`bench/speculative.py`), and the timed pass
    then measures A: no short round where a stream follows another pass's branch."""
    starts = [_chain(10 + i, 16) for i in range(8)]
    table = [tuple(s) for s in _batched_pass(None, starts, 126, tie=5)[0]]
    p = _proposer(OracleTable(6.3, tuple(table), seed=1), slots=8)
    for _ in range(6):
        outs, _ = _batched_pass(p, starts, 126, None)
        added = [tuple(s) for s in outs if tuple(s) not in table]
        if not added:
            break
        table += added
        p.set_oracle(OracleTable(6.3, tuple(table), seed=1))
    _, acceptance = _batched_pass(p, starts, 126, None)  # (20 rounds of 6.3 a stream)
    assert acceptance == pytest.approx(6.3, abs=0.02), acceptance


def test_plain_steps_between_proposals_keep_the_sequence():
    """Under `spec_policy` auto plain steps may commit tokens between two proposals: the
    second is keyed from its own position on, not by the first's draft tokens."""
    seq = _chain(6, 200)
    p = _proposer(OracleTable(3.0, (tuple(seq),)))  # (rounds end at 53, 56, ...)
    p._replace(0, seq[50], 50, ([999] * 7, None, None))
    wrong = p._replace(0, seq[52], 52, ([999] * 7, None, None))[0]
    assert wrong[0] != seq[53]  # (the round ends at 53)
    drafted = p._replace(0, seq[54], 54, ([999] * 7, None, None))[0]  # after 2 plain steps
    assert drafted[:2] == [seq[55], (seq[56] + 1) % 1000] and p.missed == 0
