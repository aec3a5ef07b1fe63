"""Errors of the runtime that cross module boundaries."""

from __future__ import annotations


class ShardFailure(RuntimeError):
    """A shard died, hung, or reported an error; the message names the shard. `runtime_down`
    is False for an error of one request after which the shards still serve."""

    def __init__(self, message: str, runtime_down: bool = True) -> None:
        super().__init__(message)
        self.runtime_down = runtime_down


class DraftLost(RuntimeError):
    """The draft process is gone (died, hung, or spoke garbage): speculation is off."""


class DraftError(RuntimeError):
    """The draft process refused one request (its message says why); it still serves."""


def draft_not_started(path: object, why: object) -> ShardFailure:
    """The start's failure when the draft process (`path`) fails before it serves."""
    return ShardFailure(f"the draft process ({path}) could not start: {why}")
