"""Prefix-cache operations of the coordinator: look up, restore, snapshot, save to disk.

The coordinator sends the shards small control messages; the KV bytes never pass through it.
A disk save: the coordinator creates `<key>.<pid>.tmp` at its final size with the header (zeroed
checksums) and writes the tokens and logits; every shard writes its own tensors at their
offsets from its snapshot memory, in the background, and reports checksums; a finalizer thread
then fills in the checksums, fsyncs, renames the file into place and fsyncs the directory
(`runtime.cache_saves`: the saves in flight).
Restores read tensors by global layer, so any split can read a file any other split wrote.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from layersplit.ipc.kv_file import (
    DTYPE_CODES,
    FEATURE_DATA,
    FEATURE_META,
    ITEMSIZE,
    LAYER_KINDS,
    KVFileError,
    checksum,
    kv_name,
    layer_tensors,
    plan,
    read_items,
    read_layout,
    write_header,
)
from layersplit.ipc.messages import message
from layersplit.runtime.cache_saves import DiskSaves
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.prefix_cache import (
    Entry,
    PrefixIndex,
    Restored,
    SaveJob,
    metadata_for,
)
from layersplit.runtime.prefix_keys import model_fingerprint, prefix_keys, weights_identity
from layersplit.runtime.resident_kv import serve, settle
from layersplit.shards.chunking import cut_points

if TYPE_CHECKING:
    from layersplit.runtime.config import RuntimeConfig
    from layersplit.runtime.scheduler import Scheduler
    from layersplit.runtime.tokenizer import TextTokenizer
    from layersplit.shards.model_config import ModelConfig

log = logging.getLogger(__name__)


class CacheHost(Protocol):
    """What the prefix cache needs of the runtime (`runtime.coordinator.Coordinator` is one):
    the model's identity and chunking, the shards and the draft to send snapshot messages to,
    and each slot's block table; the shards' host memory, shared with swapped-out sequences."""

    config: RuntimeConfig
    tokenizer: TextTokenizer | None
    model_config: ModelConfig
    model_path: Path
    dtype: str
    chunk: int
    eos_ids: tuple[int, ...]
    shards: Sequence[Any]  # each with `index` and `streams_cache`
    draft: Any  # the draft process's handle (`streams_cache`), while it serves
    draft_info: dict[str, Any]
    host_pool: HostPool | None  # each shard's host memory (`runtime.host_pool`)

    @property
    def feeding(self) -> bool: ...
    def shard_info(self) -> list[dict[str, Any]]: ...
    def call_all(self, make: Callable[[Any], Any], draft: Any = None,
                 deadline: float | None = None, what: str = "") -> list[dict[str, Any]]: ...
    def feat_sid(self, context: int) -> int: ...
    def table_update(self, slot: int) -> dict[str, Any] | None: ...
    def draft_request(self, msg: dict[str, Any], frames: Sequence[Any] = ()) -> dict[str, Any]: ...


EWMA = 0.3


class CacheManager:
    def __init__(self, coord: CacheHost) -> None:
        cfg = coord.config
        self.coord = coord
        tok = coord.tokenizer
        self.fingerprint = model_fingerprint(
            coord.model_config.to_dict(), weights_identity(coord.model_path, cfg.random_seed),
            # (KV computed from blocks kept quantized differs in the last bits: its own key)
            coord.dtype if coord.weight_format == "dequantize" else f"{coord.dtype}+blocks",
            tok.chat_template if tok else None, coord.chunk, coord.eos_ids)
        disk = Path(cfg.kv_cache_dir).expanduser() if cfg.kv_cache_dir else None
        # the RAM tier's own cap, besides each shard's host memory (`runtime.host_pool`)
        ram_cap = sys.maxsize if cfg.ram_tier_gb is None else int(cfg.ram_tier_gb * 2**30)
        self.index = PrefixIndex(self.fingerprint, ram_cap, disk,
                                 int(cfg.kv_cache_max_gb * 2**30))
        self.pool = coord.host_pool
        if self.pool is not None:  # a swap-out that needs room evicts snapshots, LRU first
            self.pool.make_room = self._make_room
        self.stats = self.index.stats
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
        infos = coord.shard_info()
        self.split = [i["layers"] for i in infos]
        self.layouts = [i["kv_layout"] for i in infos]
        self.row_bytes = sum(lay["layers"] * 2 * lay["kv_heads"] * lay["head_dim"]
                             * itemsize[lay["dtype"]] for lay in self.layouts)
        # a hybrid model's entries hold each linear layer's state whole, besides KV rows
        self.hybrid = any("linear_layers" in lay for lay in self.layouts)
        self.state_bytes = sum(
            len(lay["linear_layers"]) * (math.prod(lay["conv_shape"]) * itemsize[lay["dtype"]]
                                         + math.prod(lay["state_shape"]) * 4)
            for lay in self.layouts if "linear_layers" in lay)
        self.saves = DiskSaves(self.index, self.entry_bytes, self._after_saves)  # in flight
        self.prefill_rates: dict[int, float] = {}  # tokens/s of whole prefills, by length bucket
        self.disk_rate: float | None = None  # bytes/s, measured
        self.deferred_takes: list[tuple[Entry, int, int | None]] = []  # (entry, KV slot, the
        # sequence's draft context when the draft got the entry's feature rows)
        # the draft's feature rows go with every entry while a feature-conditioned draft serves
        self.taps = list(coord.draft_info.get("taps", [])) if coord.feeding else []
        self.feature_width = int(coord.draft_info.get("width", 0))
        self.feature_dtype = coord.draft_info.get("dtype", coord.dtype)
        self.feature_row_bytes = self.feature_width * itemsize[self.feature_dtype]
        self.index.mark_features(self._feature_tag())
        self.sched: Scheduler | None = None  # the batch's, for entries whose blocks stay in the
        # device pool (`runtime.resident_kv`; attention-only models)

    def _feature_tag(self) -> str:
        """What an entry's feature rows must be to serve this draft (metadata `features`)."""
        return json.dumps({"taps": self.taps, "width": self.feature_width}) if self.taps else ""

    def _with_features(self, entries: Sequence[Entry]) -> bool:
        return bool(self.taps) and self.coord.feeding and all(e.features for e in entries)

    def shard_tensors(self, s: int, rows: int) -> list[tuple[int, str, int, str, tuple]]:
        """Shard `s`'s tensors of an entry of `rows` KV rows: (global layer, kind, index in
        the shard's tensor of that kind, dtype code, shape)."""
        (a, b), lay = self.split[s], self.layouts[s]
        code = DTYPE_CODES[lay["dtype"]]
        out = []
        attn = lay.get("attn_layers", list(range(a, b)))
        for i, layer in enumerate(attn):
            shape = (rows, lay["kv_heads"], lay["head_dim"])
            out += [(layer, "k", i, code, shape), (layer, "v", i, code, shape)]
        for i, layer in enumerate(lay.get("linear_layers", [])):
            out += [(layer, "conv", i, code, tuple(lay["conv_shape"])),
                    (layer, "state", i, "F32", tuple(lay["state_shape"]))]
        return sorted(out, key=lambda t: (t[0], LAYER_KINDS.index(t[1])))

    def entry_bytes(self, rows: int) -> int:
        return rows * self.row_bytes + self.state_bytes

    def host_bytes(self, e: Entry) -> tuple[int, ...]:
        """Host bytes of the entry's RAM copy on each shard (what its `snap_take` allocates)."""
        return tuple(sum(math.prod(shape) * ITEMSIZE[code] for *_, code, shape in
                         self.shard_tensors(s, e.length - e.start))
                     for s in range(len(self.split)))

    # ---- keys ---------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, str]:
        return prefix_keys(self.fingerprint, tokens, self.coord.chunk, lengths)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self, prompt: Sequence[int], cuts: Sequence[int], slot: int,
                context: int | None) -> Restored:
        """Restore the longest cached prefix of `prompt` into KV slot `slot`; with a draft
        `context` (the sequence feeds the draft process) the draft gets the entries' feature
        rows too, into that context."""
        features = context is not None
        self.saves.poll_done()
        self.drop_deferred(slot)  # (a RAM copy not taken in time is simply not taken)
        n = len(prompt)
        chain = self._lookup(prompt, cuts)
        if self.sched is not None:  # (the slot's table as admission left it: `settle`)
            chain = settle(self.sched, slot, chain, n)
        if not chain:
            self.stats.misses += 1
            return Restored()
        chain = self._worth_restoring(chain)
        if not chain:
            self.stats.misses += 1
            self.stats.skipped_slow_restore += 1
            return Restored()
        t0 = time.perf_counter()
        for e in chain:
            e.pins += 1
        out = Restored(features=features and self._with_features(chain))
        try:
            ram_run: list[Entry] = []
            served, feats = (0, True) if self.sched is None else serve(
                self, chain, n, slot, context if out.features else None)
            if served:  # (its first links' blocks are still in the device pool: no copy)
                out.features &= feats
                out.length, out.leaf = chain[served - 1].length, chain[served - 1]
                out.resident = True
            for e in chain[served:]:
                if e.in_ram:
                    ram_run.append(e)
                    continue
                out.features &= self._restore_ram(ram_run, slot, context if out.features
                                                  else None)
                if ram_run:
                    out.length, out.leaf = ram_run[-1].length, ram_run[-1]
                ram_run = []
                ok, feats = self._restore_disk(e, prompt, slot,
                                               context if out.features else None)
                if not ok and self.hybrid:
                    # a shard may hold the failed link's state: start over from position 0
                    out.leaf = None
                    break
                if not ok:
                    break
                out.features &= feats
                out.tier = "disk"
                out.length, out.leaf = e.length, e
            else:
                out.features &= self._restore_ram(ram_run, slot, context if out.features
                                                  else None)
                if ram_run:
                    out.length, out.leaf = ram_run[-1].length, ram_run[-1]
        finally:
            for e in chain:
                e.pins -= 1
        if out.leaf is None:
            self.stats.misses += 1
            return Restored()
        if out.tier == "none":
            out.tier = "ram"
        if out.tier == "disk":
            self.stats.hits_disk += 1
        else:
            self.stats.hits_ram += 1
        self.index.touch(self.index.chain(out.leaf))
        if out.length == n:
            out.logits = self._logits(out.leaf)
            if out.logits is None and self.hybrid:  # the state is the leaf's: a miss
                self.stats.misses += 1
                return Restored()
            if out.logits is None:  # unreadable logits: back off to a prefill of the last row
                out.length, out.leaf = out.leaf.start, self.index.entries.get(out.leaf.parent or "")
                if out.leaf is None:
                    out.length, out.tier = 0, "none"
        self.stats.tokens_restored += out.length
        self.stats.restore_s += time.perf_counter() - t0
        return out

    def _worth_restoring(self, chain: list[Entry]) -> list[Entry]:
        """Drop disk links whose read would take longer than prefilling their tokens, judged by
        rates measured in this run (a fast GPU with a slow disk re-prefills faster)."""
        first_disk = next((i for i, e in enumerate(chain) if not e.in_ram), None)
        if first_disk is None:
            return chain
        disk_bytes = sum(e.kv_bytes for e in chain[first_disk:])
        start = chain[first_disk - 1].length if first_disk else 0
        if self.choose(chain[-1].length, chain[-1].length - start, disk_bytes) == "prefill":
            return chain[:first_disk]
        return chain

    def choose(self, end: int, tokens: int, disk_bytes: int) -> str:
        """'restore' or 'prefill' for `tokens` prompt tokens ending at `end` whose KV is
        `disk_bytes` on disk, from the rates measured so far (restore while unknown)."""
        prefill_s = self.prefill_seconds(end, tokens)
        if prefill_s is None or self.disk_rate is None:
            return "restore"
        restore_s = disk_bytes / self.disk_rate
        if restore_s > prefill_s:
            log.info("prefix cache: prefilling %d tokens (est. %.2f s) beats reading %.1f MB "
                     "(est. %.2f s)", tokens, prefill_s, disk_bytes / 1e6, restore_s)
            return "prefill"
        return "restore"

    def prefill_seconds(self, end: int, tokens: int) -> float | None:
        """Estimated time to prefill `tokens` tokens ending at position `end`: prefill speed
        depends on the context length, so rates are kept per power-of-two length bucket."""
        if not self.prefill_rates:
            return None
        b = min(self.prefill_rates, key=lambda k: abs(k - end.bit_length()))
        return tokens / self.prefill_rates[b]

    def note_prefill(self, end: int, tokens: int, seconds: float) -> None:
        """A whole prefill (request start to first token, restores excluded) measured."""
        if tokens < 16 or seconds <= 0:
            return
        b, rate = end.bit_length(), tokens / seconds
        old = self.prefill_rates.get(b)
        self.prefill_rates[b] = rate if old is None else (1 - EWMA) * old + EWMA * rate

    def _restore_ram(self, run: list[Entry], slot: int, context: int | None) -> bool:
        """Restore a run of RAM entries; True if the draft got their feature rows too (into
        `context`, when given)."""
        if not run:
            return True
        msg = message("snap_restore", entries=[e.ram_id for e in run], slot=slot,
                      blocks=self.coord.table_update(slot))
        draft = None if context is None else {**msg, "slot": context, "blocks": None}
        replies = self.coord.call_all(lambda sh: msg, draft=draft)
        return draft is not None and any(r["_shard"] < 0 for r in replies)

    def _restore_disk(self, e: Entry, prompt: Sequence[int], slot: int, context: int | None
                      ) -> tuple[bool, bool]:
        """Read one entry file into the shards (and its feature rows into the draft):
        (restored, feature rows restored)."""
        t0 = time.perf_counter()
        try:
            layout = read_layout(e.path)
            self._check_tokens(e, layout, prompt)
        except (KVFileError, OSError) as err:
            self._bad(e, str(err))
            return False, False
        by_layer = layer_tensors(layout)
        msgs = {}
        for sh_index in range(len(self.split)):
            items = []
            for layer, kind, index, _, _ in self.shard_tensors(sh_index, e.length - e.start):
                name = by_layer.get((layer, kind))
                if name is None:
                    self._bad(e, f"no tensor for layer {layer} {kind}")
                    return False, False
                t = layout.tensors[name]
                items.append({"name": name, "layer": index, "kind": kind,
                              "offset": layout.offset(name), "nbytes": t.nbytes,
                              "start": e.start, "end": e.length,
                              "checksum": layout.checksums[name]})
            stream = self.coord.shards[sh_index].streams_cache
            msg = message("snap_load", path=str(e.path), slot=slot, items=items, stream=stream,
                          blocks=None)
            if stream:  # the shard gets the bytes, read here (checked there against checksums)
                try:
                    msg = (msg, read_items(e.path, items))
                except OSError as err:
                    self._bad(e, str(err))
                    return False, False
            msgs[sh_index] = msg
        feat = self._feature_item(e, layout) if context is not None else None
        draft = None
        if feat is not None and self.coord.draft is not None:
            stream = self.coord.draft.streams_cache  # (a draft on another node)
            draft = message("snap_load", path=str(e.path), slot=context, items=[feat],
                            stream=stream, blocks=None)
            if stream:
                try:
                    draft = (draft, read_items(e.path, [feat]))
                except OSError as err:
                    self._bad(e, str(err))
                    return False, False
        blocks = self.coord.table_update(slot)  # (every shard's message has it)
        for m in msgs.values():
            (m[0] if isinstance(m, tuple) else m)["blocks"] = blocks
        replies = self.coord.call_all(lambda sh: msgs[sh.index], draft=draft)
        errors = [r["info"]["error"] for r in replies
                  if "error" in r["info"] and r["_shard"] >= 0]
        if errors:
            self._bad(e, errors[0])
            return False, False
        feats = draft is not None and any(r["_shard"] < 0 and "error" not in r["info"]
                                          for r in replies)
        if draft is not None and not feats:
            log.warning("prefix cache: %s: the draft's feature rows could not be read; this "
                        "request runs without speculation", e.path.name)
        nbytes = sum(r["info"]["bytes"] for r in replies)
        dt = time.perf_counter() - t0
        self.stats.bytes_restored_disk += nbytes
        self.stats.disk_read_s += dt
        rate = nbytes / max(dt, 1e-6)
        self.disk_rate = (rate if self.disk_rate is None else
                          (1 - EWMA) * self.disk_rate + EWMA * rate)
        if self.hybrid:  # the state is the entry's only now: its RAM copy is taken at once
            if self._room_for(e):
                self._take(e, slot, context if feats else None)
        else:  # a RAM copy, once the first token is out
            self.deferred_takes.append((e, slot, context if feats else None))
        return True, feats

    def _feature_item(self, e: Entry, layout) -> dict[str, Any] | None:
        """The draft's part of an entry file, if it has one this draft can use."""
        t = layout.tensors.get(FEATURE_DATA)
        meta = layout.tensors.get(FEATURE_META)
        if t is None or meta is None or layout.metadata.get("features") != self._feature_tag():
            return None
        if t.shape != (e.length - e.start, self.feature_width):
            return None
        return {"name": FEATURE_DATA, "layer": 0, "kind": "feat",
                "offset": layout.offset(FEATURE_DATA), "nbytes": t.nbytes, "start": e.start,
                "end": e.length, "checksum": layout.checksums[FEATURE_DATA]}

    def cached_rows(self, prompt: Sequence[int]) -> int:
        """The rows `restore` would bring back for `prompt` now, read from the index alone (a
        live sequence's blocks are shared only where they cover more: `runtime.batching`)."""
        chain = self._worth_restoring(self._lookup(
            prompt, cut_points(prompt, self.coord.chunk, self.coord.eos_ids)))
        return chain[-1].length if chain else 0

    def _lookup(self, prompt: Sequence[int], cuts: Sequence[int]) -> list[Entry]:
        """The chain of cached entries of `prompt`'s longest cached prefix ending at one of its
        `cuts` or at its end (`PrefixIndex.lookup`)."""
        n = len(prompt)
        return self.index.lookup(self.keys(prompt, sorted({n, *[c for c in cuts if c <= n]})))

    def drop_deferred(self, slot: int) -> None:
        """Forget the RAM copies queued for `slot` (its sequence ended before its first token:
        the slot's next sequence must not copy its own rows under those entries)."""
        self.deferred_takes = [d for d in self.deferred_takes if d[1] != slot]

    def take_deferred(self, slot: int) -> None:
        """RAM copies of entries just restored from disk (after the first token: the rows
        below the prompt's end do not change while the sequence decodes)."""
        mine = [d for d in self.deferred_takes if d[1] == slot]
        self.deferred_takes = [d for d in self.deferred_takes if d[1] != slot]
        for e, _, context in reversed(mine):
            if self.index.entries.get(e.key) is e and not e.in_ram and self._room_for(e):
                self._take(e, slot, context)

    def _check_tokens(self, e: Entry, layout, prompt: Sequence[int]) -> None:
        t = layout.tensors.get("tokens")
        if t is None or t.shape != (e.length,):
            raise KVFileError(f"{e.path.name}: no tokens tensor of length {e.length}")
        with open(e.path, "rb") as f:
            f.seek(layout.offset("tokens"))
            raw = f.read(t.nbytes)
        if checksum(raw) != layout.checksums["tokens"]:
            raise KVFileError(f"{e.path.name}: tokens checksum mismatch")
        if np.frombuffer(raw, dtype="<i4").tolist() != list(prompt[:e.length]):
            raise KVFileError(f"{e.path.name}: holds other tokens than its key says")
        if int(layout.metadata.get("start", -1)) != e.start:
            raise KVFileError(f"{e.path.name}: start row does not match the index")

    def _logits(self, e: Entry) -> np.ndarray | None:
        if e.logits is not None:
            return e.logits
        try:
            layout = read_layout(e.path)
            t = layout.tensors["prefill_logits"]
            with open(e.path, "rb") as f:
                f.seek(layout.offset("prefill_logits"))
                raw = f.read(t.nbytes)
            if checksum(raw) != layout.checksums["prefill_logits"]:
                raise KVFileError(f"{e.path.name}: logits checksum mismatch")
        except (KVFileError, OSError, KeyError) as err:
            self._bad(e, str(err))
            return None
        e.logits = np.frombuffer(raw, dtype="<f4").copy()
        return e.logits

    def _bad(self, e: Entry, why: str) -> None:
        if e.path is not None and e.path.exists():
            self.index.quarantine(e.path, why)
        else:
            log.warning("prefix cache: entry %s unusable: %s", e.key[:12], why)
        e.path = None
        if not e.in_ram:
            gone = self.index.drop_entry(e)
            self._drop_ram([x.ram_id for x in gone if x.ram_id is not None])
            for x in gone:
                if x is not e and x.path is not None:
                    x.path.unlink(missing_ok=True)  # unreachable without its parent

    # ---- snapshots ----------------------------------------------------------------------------
    def snapshot(self, prompt: Sequence[int], length: int, logits: np.ndarray | None,
                 parent: Entry | None, slot: int, context: int | None,
                 sync: int | None = None) -> Entry | None:
        """Cache rows [parent.length, length) of the sequence in KV slot `slot` as a child of
        `parent`; with a draft `context`, the draft holds that sequence's feature rows of
        [0, length) there and the entry carries them, once the step `sync` sent them (None:
        the last step that fed `context`; a snapshot taken later than its rows were computed
        names the step that computed them, not a later decode step whose rows the shards
        may hold parked)."""
        self.saves.poll_done()
        key = self.keys(prompt, [length])[length]
        have = self.index.entries.get(key)
        if have is not None:
            self.index.touch([have])
            self._hold(key, slot, length)
            return have
        if logits is None:
            return None
        if not np.isfinite(logits).all():  # (a row that went non-finite is never drawn from,
            # nor kept for a later exact hit to draw from: `shards.finite`)
            log.warning("no prefix-cache entry at %d tokens: its logits are not finite", length)
            return None
        if parent is not None and self.index.entries.get(parent.key) is not parent:
            parent = None  # evicted meanwhile: the live KV still holds its rows, so go full
        start = parent.length if parent is not None else 0
        feature_bytes = 0  # the draft's rows count against the caps too
        if self.taps and context is not None:
            feature_bytes = (length - start) * self.feature_row_bytes
        e = Entry(key=key, length=length, start=start, parent=parent.key if parent else None,
                  tokens=tuple(prompt[:length]), logits=logits,
                  kv_bytes=self.entry_bytes(length - start) + feature_bytes, pins=1)
        self.index.add(e)  # first: from now on the parent has a child and cannot be evicted
        try:
            if not self._room_for(e):  # (swapped-out sequences hold the rest of host memory)
                self.index.entries.pop(e.key, None)
                return None
            self._take(e, slot, context, sync)
            self._hold(key, slot, length)
            if not e.features:
                e.kv_bytes -= feature_bytes
        except BaseException:
            self.index.entries.pop(e.key, None)
            raise
        finally:
            e.pins -= 1
        if self.index.dir is not None:
            self._save(e)
        return e

    def _take(self, e: Entry, slot: int, context: int | None, sync: int | None = None) -> None:
        """RAM copies of the entry's rows of KV slot `slot` on every shard, and of its feature
        rows on the draft when the draft's `context` holds those of the whole sequence (once
        step `sync` sent them; None: the last step that fed `context`)."""
        ram_id = self.index.new_ram_id()
        take = message("snap_take", entry=ram_id, slot=slot, start=e.start, end=e.length)
        draft = None
        if self.taps and context is not None:  # after the rows of the last step arrive
            draft = {**take, "slot": context,
                     "sync": self.coord.feat_sid(context) if sync is None else sync}
        replies = self.coord.call_all(lambda sh: take, draft=draft)
        if self.pool is not None:
            self.pool.add_snapshot(ram_id, self.host_bytes(e))
        e.ram_id = ram_id
        e.features = draft is not None and any(r["_shard"] < 0 for r in replies)

    def _hold(self, key: str, slot: int, length: int) -> None:
        if self.sched is not None:  # (the slot's blocks of rows [0, length) stay, `serve`)
            self.sched.resident.hold(key, slot, length)

    def _room_for(self, e: Entry) -> bool:
        """Evict RAM copies (least recently used first) until the entry's fits the RAM tier's
        cap and every shard's host memory; False if it cannot fit there (it is not taken)."""
        need = self.host_bytes(e)
        if self.pool is None:
            self._drop_ram(self.index.evict_ram(extra=e.kv_bytes))
        else:
            self._drop_ram(self.index.evict_ram_for(lambda gone: self.pool.fits(need, gone),
                                                    extra=e.kv_bytes))
        if self.pool is not None and not self.pool.fits(need):
            log.info("prefix cache: no host memory for a RAM copy of %s (%d rows): not taken",
                     e.key[:12], e.length - e.start)
            return False
        return True

    def _make_room(self, need: tuple[int, ...]) -> None:
        """A swapped-out sequence needs `need` bytes of each shard's host memory: evict RAM
        copies, least recently used first, until they fit; none where even every free copy
        gone would leave too little (the sequence is then prefilled again, not swapped)."""
        self._drop_ram(self.index.evict_ram_for(lambda gone: self.pool.fits(need, gone)))

    def _drop_ram(self, ram_ids: list[int]) -> None:
        if self.pool is not None:
            for ram_id in ram_ids:
                self.pool.drop_snapshot(ram_id)
        if ram_ids:
            drop = message("snap_drop", entries=ram_ids)
            self.coord.call_all(lambda sh: drop, draft=drop if self.taps else None)

    def enforce_ram_cap(self) -> None:
        self._drop_ram(self.index.evict_ram())

    def _after_saves(self) -> None:
        """Finished saves changed the index: the disk cap, then the RAM cap."""
        self._drop_ram(self.index.evict_disk())
        self.enforce_ram_cap()

    # ---- disk writes ----------------------------------------------------------------------------
    def _save(self, e: Entry) -> None:
        vocab = self.coord.model_config.vocab_size
        tensors = [(kv_name(s, layer, kind), code, shape) for s in range(len(self.split))
                   for layer, kind, _, code, shape in self.shard_tensors(s, e.length - e.start)]
        tensors += [("tokens", "I32", (e.length,)), ("prefill_logits", "F32", (vocab,))]
        meta = np.asarray([self.feature_width, *self.taps], dtype="<i4")
        if e.features:
            tensors += [(FEATURE_META, "I32", meta.shape),
                        (FEATURE_DATA, DTYPE_CODES[self.feature_dtype],
                         (e.length - e.start, self.feature_width))]
        layout = plan(tensors, metadata_for(e, self.fingerprint, self.layouts, self.split,
                                            self._feature_tag() if e.features else ""))
        tmp = self.index.tmp_path_for(e.key)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename: marks the writer alive
            os.ftruncate(fd, layout.file_size)
            with os.fdopen(os.dup(fd), "r+b") as f:
                write_header(f, layout)
            sums = {}
            own = [("tokens", np.asarray(e.tokens, dtype="<i4")),
                   ("prefill_logits", np.asarray(e.logits, dtype="<f4"))]
            if e.features:
                own.append((FEATURE_META, meta))
            for name, arr in own:
                data = arr.tobytes()
                os.pwrite(fd, data, layout.offset(name))
                sums[name] = checksum(data)
        except OSError as err:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            log.warning("prefix cache: cannot create %s: %s", tmp, err)
            self.stats.save_errors += 1
            return
        writers = set(range(len(self.split))) | ({-1} if e.features else set())
        job = SaveJob(e, layout, tmp, fd, writers, sums)
        self.saves.add(job)
        draft = None
        if e.features:
            # (a draft on another node streams its rows; a lost one replies to nothing)
            stream = self.coord.draft is not None and self.coord.draft.streams_cache
            if stream:
                job.streamed_names[-1] = [FEATURE_DATA]
            draft = message("snap_save", entry=e.ram_id, path=str(tmp), items=[
                {"name": FEATURE_DATA, "layer": 0, "kind": "feat",
                 "offset": layout.offset(FEATURE_DATA)}], stream=stream)

        def items(sh) -> list[dict[str, Any]]:
            return [{"name": kv_name(sh.index, layer, kind), "layer": index, "kind": kind,
                     "offset": layout.offset(kv_name(sh.index, layer, kind))}
                    for layer, kind, index, _, _ in self.shard_tensors(sh.index, 0)]

        def save_message(sh) -> dict[str, Any]:
            its = items(sh)
            if sh.streams_cache:
                job.streamed_names[sh.index] = [it["name"] for it in its]
            return message("snap_save", entry=e.ram_id, path=str(tmp), items=its,
                           stream=sh.streams_cache)

        try:
            replies = self.coord.call_all(save_message, draft=draft)
            if draft is not None and not any(r["_shard"] < 0 for r in replies):
                self.saves.on_saved(-1, {"entry": e.ram_id, "path": str(tmp), "checksums": None,
                                         "error": "the draft did not take its part of the save",
                                         "names": []})
        except BaseException:
            self.saves.cancel(job)
            raise


