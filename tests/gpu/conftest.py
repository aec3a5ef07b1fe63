"""GPU tests: no kernel may fall back to its torch path unseen (`shards.kernels.try_kernel`
turns a failing kernel off and the torch path runs; a test comparing the two would then compare
torch with torch). Each test starts with every kernel on, and fails where one failed in its
process."""

from __future__ import annotations

import pytest
from layersplit.shards import kernels


@pytest.fixture(autouse=True)
def _no_kernel_fell_back():
    kernels._FAILED.clear()
    yield
    failed = sorted(kernels._FAILED)
    kernels._FAILED.clear()
    assert not failed, f"kernels failed and fell back to torch: {failed} (the log says why)"
