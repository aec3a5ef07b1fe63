"""The verify rows' gated delta rule kernel (`shards.kernels.gated_delta_rows`) against the torch
reference (`recurrent_gated_delta_rule(keep_states=True)`): each row's output and the state
after each row, grouped heads, a value dim that is no power of two, and the states passed in
left as they were. On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's
interpreter with `TRITON_INTERPRET=1`. Tolerances: float32 sums in another order (1e-5
relative); bf16 inputs are read as the reference reads them, the output rounded once."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers import gated_delta
from layersplit.shards.layers.gated_delta import keep_rows_rule, recurrent_gated_delta_rule

from tests.gpu import KERNEL_DEV as DEV
from tests.gpu import KERNEL_DTYPES as DTYPES
from tests.gpu import kernel_marks

pytestmark = kernel_marks()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,n,hk,hv,dk,dv", [(1, 16, 2, 4, 32, 24), (2, 5, 4, 4, 16, 16),
                                             (1, 1, 1, 3, 8, 40)])
def test_rows_kernel_matches_torch(b, n, hk, hv, dk, dv, dtype):
    from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

    g = torch.Generator().manual_seed(n * dv + hv)
    q, k = (torch.randn(b, n, hk, dk, generator=g).to(DEV, dtype) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=g).to(DEV, dtype)
    gate = (-torch.rand(b, n, hv, generator=g)).to(DEV)
    beta = torch.rand(b, n, hv, generator=g).to(DEV, dtype)
    s0 = torch.randn(b, hv, dk, dv, generator=g).to(DEV)
    before = s0.clone()
    states = torch.empty(b, n, hv, dk, dv, device=DEV)
    out = recurrent_rows(q, k, v, gate, beta, s0, states)
    want, want_states = recurrent_gated_delta_rule(q, k, v, gate, beta, s0, keep_states=True)
    assert torch.equal(s0, before)
    assert out.dtype == dtype and out.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
    assert keep_rows_rule(DEV) is not gated_delta._torch_rows  # (the kernel, not the fallback)


def test_rows_kernel_refuses_a_states_buffer_of_another_shape():
    from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

    q = torch.zeros(1, 3, 1, 8, device=DEV)
    v = torch.zeros(1, 3, 2, 8, device=DEV)
    gb = torch.zeros(1, 3, 2, device=DEV)
    with pytest.raises(ValueError, match=r"contiguous float32 \(1, 3, 2, 8, 8\)"):
        recurrent_rows(q, q, v, gb, gb, torch.zeros(1, 2, 8, 8, device=DEV),
                       torch.zeros(1, 2, 2, 8, 8, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row_advances_the_state_in_place(dtype):
    """At one row the states buffer may be the state itself (`state.unsqueeze(1)`, as a
    captured hybrid step passes it, `fused_hybrid.STATE_IN_PLACE_SWITCH`): the state after the
    row is written over it, and the output is the reference's."""
    from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 1, 2, 16, generator=g).to(DEV, dtype) for _ in range(2))
    v = torch.randn(2, 1, 4, 24, generator=g).to(DEV, dtype)
    gate = (-torch.rand(2, 1, 4, generator=g)).to(DEV)
    beta = torch.rand(2, 1, 4, generator=g).to(DEV, dtype)
    state = torch.randn(2, 4, 16, 24, generator=g).to(DEV)
    want, want_state = recurrent_gated_delta_rule(q, k, v, gate, beta, state.clone())
    out = recurrent_rows(q, k, v, gate, beta, state, state.unsqueeze(1))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_pool", [False, True])
def test_rows_over_slots_read_and_advance_each_rows_slot(in_pool):
    """`slots` (a batched step's rows, one each): row i reads the state of slot slots[i] in a
    pool; the state after it lands in a buffer or (`in_pool`) over that slot, the pool's other
    slots left as they were; the output is each sequence's own."""
    from layersplit.shards.kernels.gated_delta_rows import recurrent_rows

    g = torch.Generator().manual_seed(11)
    b, hk, hv, dk, dv = 3, 2, 4, 16, 24
    q, k = (torch.randn(b, 1, hk, dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(b, 1, hv, dv, generator=g).to(DEV)
    gate = (-torch.rand(b, 1, hv, generator=g)).to(DEV)
    beta = torch.rand(b, 1, hv, generator=g).to(DEV)
    pool = torch.randn(5, hv, dk, dv, generator=g).to(DEV)
    before = pool.clone()
    slots = torch.tensor([3, 0, 2], device=DEV)
    want, want_state = recurrent_gated_delta_rule(q, k, v, gate, beta, before[slots])
    into = pool if in_pool else torch.empty(b, 1, hv, dk, dv, device=DEV)
    out = recurrent_rows(q, k, v, gate, beta, pool, into, slots)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    after = pool[slots] if in_pool else into[:, 0]
    torch.testing.assert_close(after, want_state, rtol=1e-5, atol=1e-5)
    untouched = [1, 4] if in_pool else range(5)
    assert all(torch.equal(pool[s], before[s]) for s in untouched)
    with pytest.raises(ValueError, match="slots"):
        recurrent_rows(q.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1),
                       gate.repeat(1, 2, 1), beta.repeat(1, 2, 1), pool, pool, slots)
