"""A shard's memory outside its steps: prefix-cache snapshot operations (`shards.snapshots`
does the copies and the file I/O) and the host tier of live KV (swap preemption,
`shards.host_kv`).

`ShardCacheOps` is one part of `shards.worker.ShardServer`.
"""

from __future__ import annotations

import logging
from typing import Any

from layersplit.ipc.messages import ProtocolError, message
from layersplit.shards.snapshots import SnapshotStore, report_saves

log = logging.getLogger("layersplit.shard")


class ShardCacheOps:
    """Snapshot messages' block tables and saves reported; `kv_swap`."""

    def _report_saves(self) -> bool:
        """Tell the coordinator about disk writes the background threads finished."""
        return report_saves(self.snapshots, self._to_coordinator)

    def _snap_store(self) -> SnapshotStore:
        if self.snapshots is None:
            raise ProtocolError("prefix-cache operation before configure", "unexpected")
        return self.snapshots

    def _snap_blocks(self, msg: dict[str, Any]) -> None:
        """A snap_restore or snap_load fills its slot through the block table its `blocks`
        set (checked first, then applied: the rows it writes must be in the table)."""
        if msg["type"] not in ("snap_restore", "snap_load"):
            return
        kv, slot = self.executor.kv, msg["slot"]
        if not 0 <= slot < kv.slots:
            raise ProtocolError(f"{msg['type']}: slot {slot} outside 0..{kv.slots - 1}")
        self._check_blocks(kv, slot, msg["blocks"], None, msg["type"])
        if msg["blocks"] is not None:
            self.snapshots.wait_pending()  # (copies out of the blocks it may reassign)
            kv.set_table(slot, msg["blocks"]["at"], msg["blocks"]["ids"])

    def _on_kv_swap(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Copy a preempted sequence's blocks to the host pool (`direction` out) or back (in),
        for each [device block, host block] of `pairs`, or give back the host blocks of one
        that ended while swapped out (drop, [-1, host block]). The reply goes once the copies
        are queued: on a GPU they run on the host pool's copy stream and every kernel queued
        after them waits for them there (`shards.host_kv`), so the steps that reuse (out) or
        read (in) the device blocks run after them; on the CPU they are done."""
        if self.executor is None:
            raise ProtocolError("kv_swap before configure", "unexpected")
        if self.host_kv is None:
            raise ProtocolError("kv_swap: this shard has no host KV pool (kv_host_blocks 0)")
        direction, pairs = msg["direction"], msg["pairs"]
        if direction not in ("out", "in", "drop"):
            raise ProtocolError(f"kv_swap: direction {direction!r} must be 'out', 'in' or "
                                "'drop'")
        kv = self.executor.kv
        why = self.host_kv.pairs_error(kv, pairs, direction)
        if why is not None:
            raise ProtocolError(f"kv_swap: {why}")
        if self.snapshots is not None:
            self.snapshots.wait_pending()  # (prefix-cache copies out of blocks it overwrites)
        if direction == "drop":
            self.host_kv.drop([p[1] for p in pairs])
        elif direction == "out":
            self.host_kv.swap_out(kv, pairs)
        else:
            self.host_kv.swap_in(kv, pairs)
        self._reply(route, message("ok", info={"blocks": len(pairs)}, sid=msg.get("sid")))
