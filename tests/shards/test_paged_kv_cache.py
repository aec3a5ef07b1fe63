"""shards.paged_kv: a range executor over a paged KV pool, with block tables scrambled across
the pool, equals one over contiguous slots bit for bit on the CPU: eager prefill chunks that end
mid-block, eager decode, a tree verify step (row by row), and the static steps a CUDA graph runs
(slot-independent: the table is a step input), single and batched."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.kv_cache import KVLayout
from layersplit.shards.paged_kv import PagedKVCache

from tests.helpers import step_rows

MAX_LEN, BLOCK, BLOCKS, SLOTS = 64, 8, 24, 3
LENS = (13, 21, 5)  # prompt per slot: chunks end mid-block


def _tables() -> list[list[int]]:
    """Each slot's blocks, interleaved and out of order across the pool."""
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    return [order[s::SLOTS] for s in range(SLOTS)]  # 8 blocks = 64 rows each


@pytest.fixture(scope="module", params=[(0, 6), (2, 5)])
def pair(request, tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    start, end = request.param
    plain = RangeExecutor(load_layer_range(ckpt, start, end), MAX_LEN, SLOTS,
                          static_decode=True, graph_bucket=16)
    paged = RangeExecutor(load_layer_range(ckpt, start, end), MAX_LEN, SLOTS,
                          static_decode=True, graph_bucket=16, paged=(BLOCKS, BLOCK))
    for slot, ids in enumerate(_tables()):
        paged.kv.set_table(slot, 0, ids)
    return plain, paged


def _same_rows(plain: RangeExecutor, paged: RangeExecutor, slot: int, end: int) -> None:
    k, v = paged.kv.get_rows(slot, list(range(end)))
    assert torch.equal(k, plain.kv.k[:, slot, :end]) and torch.equal(v, plain.kv.v[:, slot, :end])


def test_paged_equals_contiguous(pair):
    plain, paged = pair
    for slot, n in enumerate(LENS):  # prefill in chunks of 6 rows: they end mid-block
        for a in range(0, n, 6):
            x = step_rows(plain.model, min(6, n - a), seed=10 * slot + a)
            want, got = plain.run(x, a, slot, all_logits=True), paged.run(x, a, slot,
                                                                         all_logits=True)
            assert torch.equal(got, want)
        _same_rows(plain, paged, slot, n)
    # static single steps (a captured graph's path): one decoder, any slot
    for step in range(3):
        for slot, n in enumerate(LENS):
            x = step_rows(plain.model, 1, seed=100 + step)
            assert torch.equal(paged.run(x, n + step, slot), plain.run(x, n + step, slot))
    assert all(key[0] == -1 for key in paged.static.graphs) or not paged.static.capture
    # a verify tree, row by row through the one-row static step (deterministic mode), then
    # its kept rows moved into place
    tree, pos, slot = [0, 1, 0], LENS[1] + 3, 1
    x = step_rows(plain.model, 4, seed=7)
    for ex in (plain, paged):
        ex.deterministic = True
    want = plain.run(x, pos, slot, all_logits=True, verify=True, tree=tree)
    got = paged.run(x, pos, slot, all_logits=True, verify=True, tree=tree)
    assert torch.equal(got, want)
    plain.before_step(slot, pos + 3, [1, 2])  # the path root -> row 1 -> row 2 kept
    paged.before_step(slot, pos + 3, [1, 2])
    _same_rows(plain, paged, slot, pos + 3)
    # a batched static step over any slots (padding rows write only the scratch block); both
    # run 2 rows (the contiguous one the window of slots 1..2), so the CPU's matmuls take the
    # same path (a different row count may round differently: AMX / AVX-512 kernels do)
    slots, positions = [2, 1], [LENS[2] + 3, pos + 3]
    x = step_rows(plain.model, 2, seed=9)
    before = paged.kv.get_rows(0, list(range(LENS[0] + 3)))
    got = paged.static.run_batch(x, slots, positions)
    want = plain.static.run_batch(x, slots, positions)
    assert torch.equal(got, want)
    for s, p in zip(slots, positions):
        _same_rows(plain, paged, s, p + 1)
    after = paged.kv.get_rows(0, list(range(LENS[0] + 3)))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    # slots with a gap: the contiguous executor's window of 3 rows pads slot 1, whose padding
    # row writes only the scratch row; the outputs agree to float32 rounding (2 rows against 3)
    slots, positions = [2, 0], [LENS[2] + 4, LENS[0] + 3]
    x = step_rows(plain.model, 2, seed=11)
    kept = [t[:, 1, :pos + 3].clone() for t in (plain.kv.k, plain.kv.v)]
    got = paged.static.run_batch(x, slots, positions)
    want = plain.static.run_batch(x, slots, positions)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(t[:, 1, :pos + 3], k) for t, k in zip((plain.kv.k, plain.kv.v), kept))


def test_table_errors_and_copies():
    kv = PagedKVCache(KVLayout(2, 2, 4, torch.float32), max_len=32, slots=2, num_blocks=6,
                      block=8)
    assert kv.max_blocks == 4 and kv.scratch_pos == 32
    assert kv.table_error(0, 0, [0, 1]) is None
    assert "at=1 outside" in kv.table_error(0, 1, [0])
    assert "block ids 0..5" in kv.table_error(0, 0, [6])
    assert "twice" in kv.table_error(0, 0, [2, 2])
    assert "exceeds the 4" in kv.table_error(0, 0, [0, 1, 2, 3, 4])
    assert "slot 2" in kv.table_error(2, 0, [0])
    kv.set_table(0, 0, [3, 1])
    kv.set_table(0, 1, [5])  # entry 1 replaced, the table ends there
    assert kv.tables[0] == [3, 5] and kv.table[0].tolist() == [3, 5, 6, 6, 6]
    kv.k_store[:, 3] = 1.0
    kv.copy_blocks([[3, 0]])
    assert torch.equal(kv.k_store[:, 0], kv.k_store[:, 3])
    with pytest.raises(IndexError, match="outside its block table of 16 rows"):
        kv.get_rows(0, [16])


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_host_pool_holds_memory_only_while_blocks_are_swapped_out(device,
                                                                       monkeypatch):
    """`HostKVPool` takes host memory at a swap-out and gives it back at the
    swap-in (or a drop), so the shard holds what the coordinator's ledger counts
    (`runtime.host_pool`); the rows come back bit for bit, into other device blocks. On a GPU
    the copies are queued on the pool's stream (page-locked buffers) and what runs after
    them on the current stream sees their result; a swap larger than the device staging
    goes in pieces."""
    from layersplit.shards import host_kv
    from layersplit.shards.host_kv import HostKVPool

    kv = PagedKVCache(KVLayout(3, 2, 4, torch.float32), MAX_LEN, SLOTS, BLOCKS, BLOCK, device)
    g = torch.Generator().manual_seed(3)
    kv.k_store.copy_(torch.randn(kv.k_store.shape, generator=g))
    kv.v_store.copy_(torch.randn(kv.v_store.shape, generator=g))
    host = HostKVPool(kv, 4)

    def settled() -> None:
        """On a GPU, a buffer is given back once the copies that used it have run."""
        if device == "cuda":
            torch.cuda.synchronize()
            host.reap()
    per_block = 2 * 3 * BLOCK * 2 * 4 * 4  # K and V, 3 layers, 8 rows of 2 x 4 floats
    assert host.nbytes == 0
    k, v = kv.k_store[:, [5, 9]].clone(), kv.v_store[:, [5, 9]].clone()
    host.swap_out(kv, [[5, 2], [9, 0]])
    assert host.nbytes == 2 * per_block and set(host.held) == {0, 2}
    assert host.held[0][0].is_pinned() == (device == "cuda")  # (page-locked on a GPU)
    assert host.pairs_error(kv, [[4, 2]], "out") == \
        "host block 2 already holds a swapped-out block"
    assert host.pairs_error(kv, [[1, 3]], "in") == "host block 3 holds nothing"
    assert host.pairs_error(kv, [[0, 2]], "drop") == \
        "drop pair [0, 2] is not [-1, host block 0..3]"
    kv.k_store[:, [5, 9]] = 0
    host.swap_in(kv, [[11, 2], [7, 0]])
    assert torch.equal(kv.k_store[:, [11, 7]], k) and torch.equal(kv.v_store[:, [11, 7]], v)
    assert not host.held
    settled()
    assert host.nbytes == 0
    host.swap_out(kv, [[1, 1], [2, 3], [3, 0]])  # 3 blocks held
    assert host.pairs_error(kv, [[-1, 1], [-1, 2]], "drop") is None  # (2: nothing to free)
    host.drop([1, 2])  # (a swap's buffer is given back with its last block: a sequence's
    assert host.nbytes == 3 * per_block and set(host.held) == {0, 3}  # come back together)
    host.drop([0, 3])
    settled()
    assert host.nbytes == 0 and not host.registered
    # pieces: a staging buffer of 2 blocks, a swap of 5 scattered blocks in three pieces, back
    # into other blocks in another order
    monkeypatch.setattr(host_kv, "STAGE_BYTES", 2 * per_block)
    small = HostKVPool(kv, 8)
    assert small.stage_blocks == 2
    dev, hosts = [12, 3, 7, 0, 9], [6, 1, 2, 5, 0]
    k, v = kv.k_store[:, dev].clone(), kv.v_store[:, dev].clone()
    small.swap_out(kv, [list(p) for p in zip(dev, hosts)])
    kv.k_store[:, dev] = 0
    kv.v_store[:, dev] = 0
    back = [2, 14, 5, 11, 8]
    order = [3, 0, 4, 1, 2]
    small.swap_in(kv, [[back[i], hosts[i]] for i in order])
    assert torch.equal(kv.k_store[:, back], k) and torch.equal(kv.v_store[:, back], v)
    small.close()
    assert small.nbytes == 0 and not small.held


def test_a_swap_out_that_fails_holds_nothing():
    """A swap-out whose copy raises (an id past the pool, which `pairs_error` would have
    refused) leaves no block held and no memory taken."""
    from layersplit.shards.host_kv import HostKVPool

    kv = PagedKVCache(KVLayout(2, 2, 4, torch.float32), MAX_LEN, SLOTS, BLOCKS, BLOCK)
    host = HostKVPool(kv, 4)
    with pytest.raises(IndexError):
        host.swap_out(kv, [[1, 0], [BLOCKS + 5, 1]])
    assert not host.held and host.nbytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_pool_copies_are_ordered_on_the_gpu(monkeypatch):
    """The copies run on the pool's stream, and the order against the current stream holds
    with slow kernels on either side: a swap-out copies the rows written after a slow kernel
    (not what was there before), and what runs after a swap-in whose copies are held back
    sees the rows it brought."""
    from layersplit.shards import host_kv
    from layersplit.shards.host_kv import HostKVPool

    kv = PagedKVCache(KVLayout(2, 2, 64, torch.float32), MAX_LEN, SLOTS, BLOCKS, BLOCK, "cuda")
    host = HostKVPool(kv, 4)
    torch.cuda._sleep(100_000_000)  # (~50 ms of the current stream)
    kv.k_store[:, [3, 5]] = 7.0
    kv.v_store[:, [3, 5]] = 8.0
    host.swap_out(kv, [[3, 0], [5, 1]])
    kv.k_store[:, [1, 2]] = 0.0
    kv.v_store[:, [1, 2]] = 0.0
    queue = host_kv.to_device

    def held_back(values, device):  # (runs on the copy stream, ahead of the copies)
        torch.cuda._sleep(100_000_000)
        return queue(values, device)

    monkeypatch.setattr(host_kv, "to_device", held_back)
    host.swap_in(kv, [[1, 0], [2, 1]])
    k, v = kv.k_store[:, [1, 2]].clone(), kv.v_store[:, [1, 2]].clone()  # (current stream)
    assert bool((k == 7.0).all()) and bool((v == 8.0).all())
    host.close()
    assert host.nbytes == 0 and not host.registered


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kept_rows_of_several_sequences_move_as_each_alone(paged):
    """`move_rows_many` (a batched step's sequences at once) leaves every row as the moves of
    each sequence one after the other do (`kept_moves`: each reads rows an earlier one did
    not write), and refuses rows outside a slot's table or the cache by name."""
    from layersplit.shards.kv_cache import KVCache
    from layersplit.shards.spec_tree import kept_moves

    layout = KVLayout(3, 2, 4, torch.float32)

    def cache():
        if not paged:
            return KVCache(layout, 48, slots=3)
        kv = PagedKVCache(layout, max_len=48, slots=3, num_blocks=12, block=8)
        for slot, blocks in enumerate(([4, 0, 7], [1, 9, 2, 5], [11, 3])):
            kv.set_table(slot, 0, blocks)
        return kv

    one, many = cache(), cache()
    for kv in (one, many):
        kv.k_store.copy_(torch.randn(kv.k_store.shape, generator=torch.Generator().manual_seed(1)))
        kv.v_store.copy_(torch.randn(kv.v_store.shape, generator=torch.Generator().manual_seed(2)))
    before = one.k_store.clone()
    moves = [(0, *kept_moves(20, [2, 5, 6])), (1, *kept_moves(30, [1, 3])), (2, [], []),
             (2, *kept_moves(12, [3, 4, 7]))]
    assert all(src for _, src, _ in moves[:2])
    for slot, src, dst in moves:
        one.move_rows(slot, src, dst)
    many.move_rows_many(moves)
    assert not torch.equal(one.k_store, before)  # (rows did move)
    assert torch.equal(one.k_store, many.k_store) and torch.equal(one.v_store, many.v_store)
    too_far = 24 if paged else 48
    with pytest.raises(IndexError, match="outside"):
        many.move_rows_many([(0, [1], [2]), (2, [too_far], [3])])
    with pytest.raises(IndexError, match="slot 3"):
        many.move_rows_many([(3, [1], [2])])
