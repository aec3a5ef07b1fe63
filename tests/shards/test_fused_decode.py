"""`shards.fused.FusedDecode`'s switches read where no GPU runs (its kernels' tests are
tests/gpu/test_decode_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards import fused


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("1", True), ("yes", True)])
def test_the_routing_in_the_routers_launch_is_off_unless_switched_on(monkeypatch, value, on):
    """`LAYERSPLIT_MOE_FUSED_ROUTE` (`kernels.switched_on`: not measured yet) decides whether
    `_moe_row` routes in its router GEMV's launch; off, nothing is made for it."""
    if value is None:
        monkeypatch.delenv(fused.FUSED_ROUTE_SWITCH, raising=False)
    else:
        monkeypatch.setenv(fused.FUSED_ROUTE_SWITCH, value)
    fast = fused.FusedDecode(compile=False)
    assert fast.fused_route is on
    if not on:
        m = torch.nn.Module()
        h = torch.zeros(1, 8)
        assert fast._fused_route(m, h, (torch.ones(8), 1e-6), h, None) is None
        assert not hasattr(m, "route_counter")
