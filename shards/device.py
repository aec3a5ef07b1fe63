"""A server process's compute setup: the device it computes on and its CPU threads."""

from __future__ import annotations

import torch


def use_device(device: str, threads: int | None) -> torch.device:
    """Make `device` this process's current device (and cap torch's threads)."""
    dev = torch.device(device)
    if threads:
        torch.set_num_threads(threads)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
