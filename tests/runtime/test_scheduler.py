"""runtime.scheduler: property tests (random submit / admit / grow / release / cancel / swap / plan
sequences against a small reference model) and a few plain examples."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from layersplit.runtime.scheduler import Ready, Scheduler, SchedulerConfig


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def configs(draw) -> SchedulerConfig:
    slots = draw(st.integers(1, 12))
    return SchedulerConfig(
        slots=slots,
        slot_tokens=draw(st.integers(1, 512)),
        block_tokens=draw(st.integers(1, 64)),
        micro_batches=draw(st.integers(1, slots)),
        step_tokens=draw(st.integers(1, 1024)),
    )


def _tokens(draw, limit: int) -> int:
    """1..limit, with the values near the limit (and the smallest) drawn often."""
    return draw(st.one_of(
        st.integers(1, limit),
        st.sampled_from(sorted({1, max(1, limit - 1), limit})),
    ))


def _draw_ready(draw, rids, budget: int) -> list[Ready]:
    """Ready segments for `rids` (in the given order): rows on a scale drawn per list, so that
    steps with many segments that fit, and ones with segments over the budget, both come up."""
    scale = draw(st.sampled_from([1, 2, max(1, budget // 4), budget, 2 * budget]), label="scale")
    return [Ready(rid, draw(st.integers(1, scale), label="rows"), draw(st.booleans(),
                                                                       label="decode"))
            for rid in rids]


def _state(s: Scheduler):
    return ([(r.rid, r.slot, r.group, r.order, r.blocks) for r in s.running.values()],
            s.free_blocks, [list(f) for f in s.free_slots], list(s.waiting))


def _check_plan(s: Scheduler, ready: list[Ready]) -> list:
    """Calls s.plan(ready) and checks what it returns against the rules of a step."""
    budget = s.config.step_tokens
    before = _state(s)
    chosen = s.plan(ready)
    assert _state(s) == before, "planning changed the scheduler"
    if not ready:
        assert chosen == []
        return chosen
    by_rid = {x.rid: x for x in ready}
    assert chosen, "a step always takes at least one segment"
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(by_rid), "plan returned a rid it was not given"
    rows = sum(by_rid[r].rows for r in chosen)
    assert len(chosen) == 1 or rows <= budget, ("over budget", ready, chosen)
    kinds = [by_rid[r].decode for r in chosen]
    assert kinds == sorted(kinds, reverse=True), "decode segments come before prefill"
    order = {x.rid: s.running[x.rid].order for x in ready}
    # decode: oldest first; one is left out only if it does not fit with the chosen ones
    decodes = [r for r in chosen if by_rid[r].decode]
    assert decodes == sorted(decodes, key=order.__getitem__)
    if any(x.decode for x in ready):
        assert kinds[0], "a ready decode segment is never crowded out entirely"
    for x in ready:
        if x.decode and x.rid not in chosen:
            assert rows + x.rows > budget, ("a decode that fits was left out", ready, chosen)
    # prefill: a prefix of the chunks sorted oldest first; the first left out did not fit
    prefills = sorted((x.rid for x in ready if not x.decode), key=order.__getitem__)
    took = [r for r in chosen if not by_rid[r].decode]
    assert took == prefills[: len(took)], ("a younger chunk overtook an older one", ready, chosen)
    if len(took) < len(prefills):
        assert rows + by_rid[prefills[len(took)]].rows > budget, ("a chunk that fits waits",
                                                                   ready, chosen)
    return chosen


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one Scheduler through random operations, checking each against a reference model:
    the waiting queue (FIFO), the tokens each running sequence has reached, its expected blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None

    @initialize(config=configs(), data=st.data())
    def setup(self, config: SchedulerConfig, data) -> None:
        assert Scheduler(config).total_blocks == config.slots * config.blocks_per_slot
        # Sometimes shrink the block pool below one full slot per slot (a shared paged pool):
        # the only way blocks, not slots, can stop admission or fail a grow()
        self.shrunk = data.draw(st.booleans(), label="shrink pool")
        if self.shrunk:
            pool = data.draw(st.integers(1, config.slots * config.blocks_per_slot),
                             label="pool blocks")
            config = dataclasses.replace(config, num_blocks=pool)
        self.c = config
        self.s = Scheduler(config)
        self.next_rid = 0
        self.waiting: list[tuple[int, int]] = []  # model of the queue: (rid, prompt tokens)
        self.tokens: dict[int, int] = {}  # running rid -> rows its slot holds (model)
        self.submitted: list[int] = []
        self.admitted: list[int] = []  # in admission order
        self.released: set[int] = set()
        self.swapped: dict[int, int] = {}  # swapped-out rid -> the slot it keeps (model)

    # ---- helpers ------------------------------------------------------------------------------
    def _expected_blocks(self, rid: int) -> int:
        return _ceil(self.tokens[rid], self.c.block_tokens)

    # ---- rules --------------------------------------------------------------------------------
    @precondition(lambda self: self.s is not None)
    @rule(data=st.data())
    def submit(self, data) -> None:
        rid = self.next_rid
        self.next_rid += 1
        prompt = data.draw(st.one_of(
            st.integers(1, self.c.slot_tokens),
            st.sampled_from(sorted({1, max(1, self.c.slot_tokens - 1), self.c.slot_tokens})),
            st.sampled_from([0, -1, self.c.slot_tokens + 1]),  # rejected
        ), label="prompt size")
        if not 0 < prompt <= self.c.slot_tokens or \
                _ceil(prompt, self.c.block_tokens) > self.s.total_blocks:
            with pytest.raises(ValueError, match="does not fit"):
                self.s.submit(rid, prompt)
            return
        self.s.submit(rid, prompt)
        self.waiting.append((rid, prompt))
        self.submitted.append(rid)

    @precondition(lambda self: self.s is not None and (self.waiting or self.s.running))
    @rule(data=st.data())
    def submit_duplicate(self, data) -> None:
        known = [r for r, _ in self.waiting] + list(self.tokens)
        rid = data.draw(st.sampled_from(known), label="duplicate rid")
        with pytest.raises(ValueError, match="already known"):
            self.s.submit(rid, 1)

    @precondition(lambda self: self.s is not None)
    @rule()
    def admit(self) -> None:
        s = self.s
        free = [list(f) for f in s.free_slots]
        free_blocks = s.free_blocks
        admitted = s.admit()
        # FIFO: the admitted rids are the head of the queue, in submission order.
        assert [r for r, _ in admitted] == [r for r, _ in self.waiting[: len(admitted)]]
        for (rid, slot), (_, prompt) in zip(admitted, self.waiting):
            need = _ceil(prompt, self.c.block_tokens)
            assert need <= free_blocks
            if rid in self.swapped:  # back in the slot it kept, taking no free slot
                assert slot == self.swapped.pop(rid)
                free_blocks -= need
                self.tokens[rid] = prompt
                continue
            counts = [len(f) for f in free]
            # the group with the most free slots (ties: the lowest group)
            group = max(range(len(free)), key=lambda g: (counts[g], -g))
            assert counts[group] > 0
            assert slot == min(free[group]), (slot, free)  # lowest free slot of that group
            assert slot in s.group_slots[group]
            assert s.group_of(rid) == group
            free[group].remove(slot)
            free_blocks -= need
            self.tokens[rid] = prompt
            self.admitted.append(rid)
        self.waiting = self.waiting[len(admitted):]
        if self.waiting and self.waiting[0][0] in self.swapped:
            # a swapped head needs blocks only; in a full-size pool it always has them (the
            # sequences running hold at most a slot's worth each, and its own slot is free)
            assert _ceil(self.waiting[0][1], self.c.block_tokens) > free_blocks
            assert self.shrunk
        elif self.waiting:
            # admission stopped at the first request that does not fit
            need = _ceil(self.waiting[0][1], self.c.block_tokens)
            assert not any(free) or need > free_blocks, (free, need, free_blocks)
            if not self.shrunk:
                # with one slot's worth of blocks per slot, only slots can run out
                assert not any(free)
        assert free == s.free_slots and free_blocks == s.free_blocks

    @precondition(lambda self: self.s is not None and self.s.running)
    @rule(data=st.data())
    def grow(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        tokens = _tokens(data.draw, self.c.slot_tokens)
        new = max(self.tokens[rid], tokens)
        extra = _ceil(new, self.c.block_tokens) - self.s.running[rid].blocks
        before = self.s.free_blocks
        if extra > before:
            assert self.shrunk  # a full-size pool always has room for a slot's own blocks
            with pytest.raises(RuntimeError, match="KV blocks"):
                self.s.grow(rid, tokens)
            assert self.s.free_blocks == before  # a failed grow changes nothing
            return
        self.s.grow(rid, tokens)
        self.tokens[rid] = new
        assert self.s.free_blocks == before - max(0, extra)

    @precondition(lambda self: self.s is not None and self.s.running)
    @rule(data=st.data())
    def grow_past_slot(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        over = self.c.slot_tokens + data.draw(st.integers(1, 64), label="over")
        blocks, free = self.s.running[rid].blocks, self.s.free_blocks
        with pytest.raises(ValueError, match="exceed a slot"):
            self.s.grow(rid, over)
        assert self.s.running[rid].blocks == blocks and self.s.free_blocks == free

    @precondition(lambda self: self.s is not None and self.s.running)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        r = self.s.running[rid]
        slot, group, blocks, free = r.slot, r.group, r.blocks, self.s.free_blocks
        assert self.s.cancel_waiting(rid) is False  # running, not waiting
        self.s.release(rid)
        del self.tokens[rid]
        self.released.add(rid)
        assert rid not in self.s.running
        assert slot in self.s.free_slots[group]
        assert self.s.free_blocks == free + blocks
        with pytest.raises(KeyError):
            self.s.release(rid)  # not twice

    @precondition(lambda self: self.s is not None and self.waiting)
    @rule(data=st.data())
    def cancel_waiting(self, data) -> None:
        i = data.draw(st.integers(0, len(self.waiting) - 1), label="index")
        rid, _ = self.waiting.pop(i)
        assert self.s.cancel_waiting(rid) is True
        assert self.s.cancel_waiting(rid) is False
        if rid in self.swapped:  # its slot is free again
            slot = self.swapped.pop(rid)
            assert slot in self.s.free_slots[[slot in g for g in self.s.group_slots].index(True)]
            self.released.add(rid)

    @precondition(lambda self: self.s is not None and self.s.running)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        """Preempted by swap: blocks free at once, slot kept, head of the queue for the
        blocks of `tokens` rows (its next step's, at least the rows it held)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        tokens = data.draw(st.integers(self.tokens[rid], self.c.slot_tokens), label="tokens")
        r = self.s.running[rid]
        slot, blocks, free = r.slot, r.blocks, self.s.free_blocks
        if _ceil(tokens, self.c.block_tokens) > self.s.total_blocks:
            with pytest.raises(ValueError, match="exceed the KV pool"):
                self.s.swap_out(rid, tokens)
            assert rid in self.s.running and self.s.free_blocks == free  # nothing changed
            return
        self.s.swap_out(rid, tokens)
        del self.tokens[rid]
        self.swapped[rid] = slot
        self.waiting.insert(0, (rid, tokens))
        assert self.s.free_blocks == free + blocks
        assert all(slot not in f for f in self.s.free_slots)
        with pytest.raises(ValueError, match="not free to drive by hand"):
            self.s.hold_slot(slot, 1, new=True)

    @precondition(lambda self: self.s is not None)
    @rule()
    def cancel_unknown(self) -> None:
        assert self.s.cancel_waiting(("nobody", self.next_rid)) is False

    @precondition(lambda self: self.s is not None and self.s.running)
    @rule(data=st.data())
    def plan(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), unique=True, min_size=1),
                         label="ready rids")
        ready = _draw_ready(data.draw, rids, self.c.step_tokens)
        _check_plan(self.s, ready)
        # admission order and `order` agree
        order = {r: self.s.running[r].order for r in rids}
        assert sorted(rids, key=order.__getitem__) == [r for r in self.admitted if r in order]

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        s = self.s
        if s is None:
            return
        s.check()
        assert {rid: r.slot for rid, r in s.swapped.items()} == self.swapped
        held = [r.slot for r in (*s.running.values(), *s.swapped.values())]
        assert len(held) == len(set(held)), "a slot is held by two requests"
        free = [x for f in s.free_slots for x in f]
        assert sorted(held + free) == list(range(self.c.slots))
        assert s.free_blocks >= 0
        assert s.free_blocks + sum(r.blocks for r in s.running.values()) == s.total_blocks
        waiting = [r for r, _ in s.waiting]
        assert waiting == [r for r, _ in self.waiting]
        assert not set(waiting) & set(s.running), "a request is both waiting and running"
        assert set(s.running) == set(self.tokens)
        for rid, r in s.running.items():
            assert r.rid == rid
            assert r.slot in s.group_slots[r.group], "a sequence runs outside its group"
            assert r.blocks == self._expected_blocks(rid)
        # groups: contiguous, covering every slot, sizes within one of each other
        spans = [list(g) for g in s.group_slots]
        assert [x for g in spans for x in g] == list(range(self.c.slots))
        assert len(spans) == self.c.micro_batches
        assert max(map(len, spans)) - min(map(len, spans)) <= 1
        for g, f in enumerate(s.free_slots):
            assert all(x in s.group_slots[g] for x in f)

    def teardown(self) -> None:
        s = self.s
        if s is None:
            return
        # Finish everything: release all running, admit what waits, until the queue drains or
        # nothing more fits (only possible with a shrunk pool smaller than a prompt's blocks).
        while True:
            for rid in list(s.running):
                s.release(rid)
                self.released.add(rid)
                s.check()
            admitted = s.admit()
            s.check()
            again = [r for r, _ in admitted if r in self.swapped]
            for r in again:
                del self.swapped[r]
            self.admitted += [r for r, _ in admitted if r not in again]
            if not admitted:
                break
        assert not s.running
        assert sorted(x for f in s.free_slots for x in f) == list(range(self.c.slots))
        assert s.free_blocks == s.total_blocks, "KV blocks leaked"
        assert set(self.admitted) == self.released, "an admitted request was never released"
        assert len(self.admitted) == len(set(self.admitted))
        # admissions, over the whole run, in submission order
        pos = {r: i for i, r in enumerate(self.submitted)}
        assert [pos[r] for r in self.admitted] == sorted(pos[r] for r in self.admitted)
        # what still waits is stuck behind a head that cannot fit even an empty scheduler
        # (FIFO: the smaller requests behind it wait too)
        assert not s.waiting  # (a prompt larger than the whole pool is refused at submit)


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    slots=st.integers(-2, 14),
    slot_tokens=st.integers(-2, 600),
    block_tokens=st.integers(-2, 70),
    micro_batches=st.integers(-2, 14),
    step_tokens=st.integers(-2, 1100),
)
def test_config_validation(slots, slot_tokens, block_tokens, micro_batches, step_tokens):
    ok = (slots >= 1 and slot_tokens >= 1 and block_tokens >= 1
          and 1 <= micro_batches <= slots and step_tokens >= 1)
    kw = {"slots": slots, "slot_tokens": slot_tokens, "block_tokens": block_tokens,
          "micro_batches": micro_batches, "step_tokens": step_tokens}
    if ok:
        c = SchedulerConfig(**kw)
        assert c.blocks_per_slot * block_tokens >= slot_tokens
        assert (c.blocks_per_slot - 1) * block_tokens < slot_tokens
    else:
        with pytest.raises(ValueError, match=r"\S"):
            SchedulerConfig(**kw)


@settings(max_examples=200, deadline=None)
@given(config=configs(), data=st.data())
def test_plan_properties(config, data):
    """plan() alone, on many running sequences admitted (and some released) in random order."""
    s = Scheduler(config)
    n = data.draw(st.integers(1, config.slots), label="sequences")
    for rid in range(n):
        s.submit(rid, data.draw(st.integers(1, config.slot_tokens), label="prompt"))
    assert [r for r, _ in s.admit()] == list(range(n))
    for rid in data.draw(st.lists(st.sampled_from(range(n)), unique=True, max_size=n - 1),
                         label="released"):
        s.release(rid)
        s.submit(f"again-{rid}", 1)
    s.admit()
    s.check()
    rids = data.draw(st.permutations(sorted(s.running, key=str)), label="order")
    k = data.draw(st.integers(0, len(rids)), label="ready count")
    _check_plan(s, _draw_ready(data.draw, rids[:k], config.step_tokens))


# ---- examples -------------------------------------------------------------------------------


def _cfg(**kw) -> SchedulerConfig:
    base = {"slots": 4, "slot_tokens": 64, "block_tokens": 16, "micro_batches": 1,
            "step_tokens": 128}
    return SchedulerConfig(**{**base, **kw})


def test_fifo_admission_waits_for_blocks():
    """A request whose prompt blocks do not fit stops admission, though a later small one would
    fit: it must wait, and is admitted first once blocks are released. (With the default
    `slots * blocks_per_slot` pool, a free slot always has room.)"""
    s = Scheduler(_cfg(slots=3, num_blocks=5))  # a shared pool smaller than 3 slots x 4 blocks
    s.submit("a", 48)  # 3 blocks
    assert s.admit() == [("a", 0)]
    s.submit("big", 64)  # 4 blocks: only 2 free
    s.submit("small", 1)  # 1 block: would fit
    assert s.admit() == []
    assert [r for r, _ in s.waiting] == ["big", "small"]
    assert set(s.running) == {"a"}
    s.check()
    s.release("a")
    assert s.admit() == [("big", 0), ("small", 1)]
    s.check()


def test_default_pool_never_blocks_a_free_slot():
    s = Scheduler(_cfg(slots=2, slot_tokens=64, block_tokens=16))
    s.submit("a", 1)
    s.admit()
    s.grow("a", 64)  # a full slot's blocks
    s.submit("b", 64)
    assert s.admit() == [("b", 1)]
    s.submit("c", 1)
    assert s.admit() == []  # no slot left
    s.check()


def test_grow_past_slot_tokens_raises():
    s = Scheduler(_cfg())
    s.submit("a", 10)
    s.admit()
    s.grow("a", 64)
    with pytest.raises(ValueError, match="65 tokens exceed a slot of 64"):
        s.grow("a", 65)
    assert s.running["a"].blocks == 4
    s.check()


def test_submit_duplicate_and_bad_prompt_raise():
    s = Scheduler(_cfg(slots=1))
    s.submit("a", 10)
    with pytest.raises(ValueError, match="already known"):
        s.submit("a", 10)  # waiting
    s.admit()
    with pytest.raises(ValueError, match="already known"):
        s.submit("a", 5)  # running
    s.submit("b", 64)
    with pytest.raises(ValueError, match="already known"):
        s.submit("b", 1)
    with pytest.raises(ValueError, match="does not fit"):
        s.submit("c", 65)
    with pytest.raises(ValueError, match="does not fit"):
        s.submit("d", 0)
    s.release("a")
    s.submit("a", 3)  # a finished rid may come back
    assert [r for r, _ in s.waiting] == ["b", "a"]


@pytest.mark.parametrize("kw, match", [
    ({"micro_batches": 5}, r"micro_batches=5 must be 1\.\.slots \(4\)"),
    ({"micro_batches": 0}, "micro_batches=0"),
    ({"slots": 0, "micro_batches": 0}, "bad sizes"),
    ({"slot_tokens": 0}, "bad sizes"),
    ({"block_tokens": 0}, "bad sizes"),
    ({"step_tokens": 0}, "step_tokens=0 must be at least 1"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_released_slot_is_reused():
    s = Scheduler(_cfg(slots=3))
    for rid in "abc":
        s.submit(rid, 16)
    assert s.admit() == [("a", 0), ("b", 1), ("c", 2)]
    s.release("b")
    s.submit("d", 16)
    assert s.admit() == [("d", 1)]
    assert s.free_blocks == s.total_blocks - 3
    s.check()


def test_new_sequences_go_to_the_group_with_most_free_slots():
    s = Scheduler(_cfg(slots=5, micro_batches=2))  # groups: slots 0-1 and 2-4
    assert [list(g) for g in s.group_slots] == [[0, 1], [2, 3, 4]]
    for rid in "abcde":
        s.submit(rid, 1)
    got = s.admit()
    assert got == [("a", 2), ("b", 0), ("c", 3), ("d", 1), ("e", 4)]
    assert [s.group_of(r) for r in "abcde"] == [1, 0, 1, 0, 1]
    s.check()


def test_plan_decode_first_and_prefill_oldest_first():
    s = Scheduler(_cfg(slots=4, step_tokens=10))
    for rid in "abcd":
        s.submit(rid, 1)
    s.admit()
    # d's prefill is youngest and small; b's is older and too big: d must not overtake b
    plan = s.plan([Ready("d", 1, False), Ready("b", 9, False), Ready("c", 2, True),
                   Ready("a", 3, True)])
    assert plan == ["a", "c"]
    # a decode that does not fit is skipped, a later smaller one still goes
    assert s.plan([Ready("a", 8, True), Ready("b", 5, True), Ready("c", 2, True)]) == ["a", "c"]
    # one oversized segment still goes alone
    assert s.plan([Ready("b", 50, False), Ready("c", 1, False)]) == ["b"]
    assert s.plan([]) == []


def test_a_requeued_sequence_keeps_its_age():
    """Preemption takes the youngest: a sequence preempted and run again stays older than
    those admitted after it (else it would be the youngest, picked again and again)."""
    s = Scheduler(_cfg(slots=3))
    for rid in "abc":
        s.submit(rid, 16)
    s.admit()
    s.requeue("a", 20)
    s.check()
    assert s.admit() == [("a", 0)]
    assert sorted(s.running, key=lambda r: s.running[r].order) == ["a", "b", "c"]
    s.requeue("b", 20)
    assert s.cancel_waiting("b")
    s.submit("d", 16)
    s.admit()
    assert s.running["d"].order > s.running["c"].order
    s.check()
