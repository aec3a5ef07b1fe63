"""`LAYERSPLIT_*` switches read from the environment: one way to read them, importing nothing
heavy (a prestarted process reads one before torch is imported, `shards.cuda_context`)."""

from __future__ import annotations

import os


def switched_off(name: str) -> bool:
    """Whether the `LAYERSPLIT_*` switch `name` is set off (0, false, off or no; unset: on)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def switched_on(name: str) -> bool:
    """Whether the `LAYERSPLIT_*` switch `name`, off unless set, is set on (1, true, on or
    yes): a path not yet measured where it would be the default."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")
