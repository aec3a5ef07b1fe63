"""runtime.block_manager: a stateful property test (random allocate / free / fork against a
model of what each sequence should hold, `check_integrity` after every operation) and examples."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from layersplit.runtime.block_manager import BlockManager


class BlockMachine(RuleBasedStateMachine):
    @initialize(blocks=st.integers(1, 24), block=st.integers(1, 8))
    def setup(self, blocks: int, block: int) -> None:
        self.bm = BlockManager(blocks, block)
        self.tokens: dict[int, int] = {}  # seq -> rows its table covers (model)
        self.shared: dict[int, list[int]] = {}  # seq -> the blocks it got by fork

    @rule(seq=st.integers(0, 5), tokens=st.integers(0, 80))
    def allocate(self, seq: int, tokens: int) -> None:
        before = self.bm.table(seq)
        free = self.bm.free_blocks
        need = max(0, self.bm.blocks_for(tokens) - len(before))
        assert self.bm.can_allocate(tokens, seq) == (need <= free)
        if need > free:
            with pytest.raises(MemoryError):
                self.bm.allocate(seq, tokens)
            assert self.bm.table(seq) == before and self.bm.free_blocks == free
            return
        new = self.bm.allocate(seq, tokens)
        assert len(new) == need and self.bm.table(seq) == before + new
        assert self.bm.free_blocks == free - need
        if seq in self.bm.tables:
            self.tokens[seq] = max(self.tokens.get(seq, 0), tokens)

    @rule(seq=st.integers(0, 5))
    def free(self, seq: int) -> None:
        self.bm.free(seq)
        self.tokens.pop(seq, None)
        self.shared.pop(seq, None)
        assert self.bm.table(seq) == []

    @rule(src=st.integers(0, 5), dst=st.integers(0, 5), frac=st.floats(0, 1))
    def fork(self, src: int, dst: int, frac: float) -> None:
        if src not in self.tokens or dst in self.bm.tables:
            return
        tokens = int(self.tokens[src] * frac)
        src_table = self.bm.table(src)
        full, part = divmod(tokens, self.bm.block_tokens)
        if part and self.bm.free_blocks == 0:
            with pytest.raises(MemoryError):
                self.bm.fork(src, dst, tokens)
            return
        copies = self.bm.fork(src, dst, tokens)
        table = self.bm.table(dst)
        assert table[:full] == src_table[:full]  # shared by reference
        assert copies == ([(src_table[full], table[full])] if part else [])
        assert len(table) == full + bool(part)
        self.tokens[dst] = tokens

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_integrity()


BlockMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = BlockMachine.TestCase


def test_fork_shares_full_blocks_and_frees_them_last() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)  # 3 blocks: 0, 1, 2 (the last holds 2 rows)
    assert bm.fork("a", "b", 10) == [(2, 3)]  # rows 8, 9 are copied into a block of b's own
    # (the copy's source is held for b until its copy is made: a pin)
    assert bm.table("b") == [0, 1, 3] and bm.refs[:4] == [2, 2, 2, 1]
    bm.free("a")
    assert bm.free_blocks == 4 and bm.table("b")[:2] == [0, 1]  # still b's; 2 still pinned
    bm.check_integrity()
    bm.unpin("b")  # the copy is made
    assert bm.free_blocks == 5 and bm.refs[2] == 0
    bm.free("b")
    assert bm.free_blocks == 8
    bm.check_integrity()


def test_freeing_a_fork_drops_its_pins() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("a", 6)
    bm.fork("a", "b", 6)
    bm.free("a")
    bm.free("b")  # (ended before its copy was made)
    assert bm.free_blocks == 4 and not bm.pins
    bm.check_integrity()


def test_exhaustion_raises_and_changes_nothing() -> None:
    bm = BlockManager(2, 16)
    bm.allocate(0, 20)
    with pytest.raises(MemoryError, match="KV pool"):
        bm.allocate(1, 17)
    assert bm.table(1) == [] and bm.free_blocks == 0
    bm.check_integrity()
