"""What a `runtime.batching.Batcher` did: its counters (`Batcher.stats`; the server's metrics
read them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class BatchStats:
    steps: int = 0  # steps sent
    segments: int = 0  # sequences' segments in them
    widest: int = 0  # most segments in one step
    most_in_flight: int = 0  # most steps in the chain at once
    preemptions: int = 0  # sequences whose blocks were taken back (swapped or re-prefilled)
    shared_tokens: int = 0  # prompt rows new sequences took from live ones' blocks
    swapped_out: int = 0  # preemptions by swap: blocks copied to the host pool
    swapped_in: int = 0  # swapped sequences whose blocks came back
    reprefills: int = 0  # preemptions by re-prefill (the sequence runs again from its tokens)
    stale_restarts: int = 0  # sequences run again from their tokens because their recurrent
    # state took a lookahead row their program did not then ask for (`Batcher._adopt`)
    rows: int = 0  # rows of the segments sent (a re-prefill computes rows again)
    host_blocks: int = 0  # host-pool blocks held by swapped sequences now
    ahead: int = 0  # lookahead steps sent (decode steps sent before their tokens were known;
    # counted in `steps` too)
    parked: int = 0  # steps whose feature rows the shards parked (`shards.parked_rows`)
    ahead_dropped: int = 0  # lookahead segments whose output went unused: the sequence stopped
    # (or asked for another step; its row is then computed again, the same row: KV models only)
