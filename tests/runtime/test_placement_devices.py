"""The coordinator's quick count of local CUDA devices (`placement.visible_cuda_devices`): what
`CUDA_VISIBLE_DEVICES` leaves of the GPUs under /proc/driver/nvidia/gpus, by CUDA's rules, never
more than CUDA would see (its yes is final); where it cannot know, None (the driver is asked)."""

from __future__ import annotations

import pytest
from layersplit.runtime import placement
from layersplit.runtime.placement import Placement, PlacementError, ShardPlan


@pytest.fixture()
def four_gpus(monkeypatch):
    real = placement.os.listdir

    def listdir(path):
        if path == "/proc/driver/nvidia/gpus":
            return ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]
        return real(path)

    monkeypatch.setattr(placement.os, "listdir", listdir)
    return monkeypatch


@pytest.mark.parametrize("visible,count", [
    (None, 4), ("", 0), ("0", 1), ("0,1", 2), (" 0 , 1 ", 2), ("0,5,1", 1), ("0,-1,1", 1),
    (",0", 0), ("0,,1", 1), ("3,2,1,0", 4), ("²", 0), ("+1", 0),
    ("0,0", None), ("1,0,1", None), ("GPU-a", None), ("0,GPU-a", None), ("MIG-x,MIG-y", None),
])
def test_the_quick_count_follows_cuda_visible_devices(four_gpus, visible, count):
    if visible is None:
        four_gpus.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        four_gpus.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert placement.visible_cuda_devices() == count


def test_a_device_the_quick_count_lacks_is_the_drivers_to_refuse(four_gpus):
    """A device the quick count finds passes without the driver; one it does not find is
    asked of the driver (`cuda_device_count`), whose no is the error."""
    asked = []
    four_gpus.setattr(placement, "cuda_device_count", lambda: asked.append(1) or 4)
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    placement.check_local_devices(Placement((ShardPlan(0, 0, 1, "cuda:1", None),), ()))
    assert asked == []
    with pytest.raises(PlacementError, match="cuda:2 does not exist here"):
        four_gpus.setattr(placement, "cuda_device_count", lambda: asked.append(1) or 2)
        placement.check_local_devices(Placement((ShardPlan(0, 0, 1, "cuda:2", None),), ()))
    assert asked == [1]
