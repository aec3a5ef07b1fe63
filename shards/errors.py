"""Errors raised while loading or running a model range."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (HF folder or GGUF) is unusable; the message names the file and field/tensor."""
