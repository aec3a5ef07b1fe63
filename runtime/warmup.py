"""Warm-up before "ready": every kind of request the server runs, run once, so that what a
process compiles, autotunes or allocates on first use is paid before the first request.

At start each shard already captures its step graphs and launches its prefill kernels once
(`ShardGroup._warm`, `StaticDecoder.warm`), recording the warm-up in its compile cache
(`shards.compile_cache`). What only a real step shows is warmed here, through the ordinary
request path: a prefill of a full chunk and of a part of one (attention and autotuned kernels
at prefill shapes), greedy decode steps (speculative verify steps where a draft serves greedy
requests), a sampled request (the sampling kernels), a batch of two (batched steps), and with a
disk cache, a restore of its most recently used entry (the disk read and copy-back path a
restart's first request takes). These requests take nothing from the prefix cache and leave
nothing in it (the restore's entry excepted, which it only reads) and its statistics are put
back: they are not users' requests.

On CPUs nothing compiles, so `warmup = auto` skips it there; `layersplit warmup` runs it on any
device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
from layersplit.ipc.kv_file import KVFileError, read_layout
from layersplit.runtime.generate import GenerationResult
from layersplit.shards.sampling_params import SamplingParams

if TYPE_CHECKING:
    from layersplit.runtime.coordinator import Coordinator

log = logging.getLogger(__name__)

NEW_TOKENS = 8  # tokens each warm-up request decodes (a few speculative rounds)
PART_CHUNK = 17  # the tokens of a prefill's last, partial chunk


def wanted(coord: Coordinator) -> bool:
    """Whether `warmup` asks for the warm-up requests on this run."""
    mode = coord.config.warmup
    if mode != "auto":
        return mode == "on"
    devices = [s.device for s in coord.placement.shards]
    if coord.draft is not None:
        devices.append(coord.draft_device)
    return any(d.startswith("cuda") for d in devices)


def _prompt(n: int, vocab: int, salt: int = 0) -> list[int]:
    """`n` token ids spread over the vocabulary (none 0), the same on every run."""
    return [(i * 7919 + salt * 104729) % (vocab - 1) + 1 for i in range(n)]


def run(coord: Coordinator, force: bool = False) -> float:
    """The warm-up requests on the started coordinator `coord` (where `wanted`, or `force`);
    returns their seconds (0 where none ran). Progress is logged, a line per request."""
    if not (force or wanted(coord)):
        return 0.0
    cfg = coord.config
    vocab = coord.model_config.vocab_size
    room = cfg.max_context - NEW_TOKENS - 1
    long_n = max(1, min(coord.chunk + PART_CHUNK, room))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    steps: list[tuple[str, object]] = [
        (f"a prefill of {long_n} tokens and {NEW_TOKENS} greedy tokens",
         lambda: coord.generate(_prompt(long_n, vocab), greedy, use_cache=False)),
        ("a sampled request",
         lambda: coord.generate(_prompt(min(PART_CHUNK, room), vocab, 1), sampled,
                                use_cache=False)),
    ]
    if cfg.max_seqs >= 2:
        steps.append(("a batch of two", lambda: coord.generate_batch(
            [_prompt(min(PART_CHUNK, room), vocab, 2), _prompt(min(5, room), vocab, 3)],
            [greedy, sampled], use_cache=False)))
    restore = _restore_prompt(coord)
    if restore is not None:
        steps.append((f"a request for the {len(restore)} tokens of a disk-cache entry",
                      lambda: coord.generate(restore, SamplingParams(max_tokens=2,
                                                                     ignore_eos=True))))
    t0 = time.perf_counter()
    stats = dataclasses.replace(coord.cache.stats) if coord.cache is not None else None
    for i, (what, go) in enumerate(steps, 1):
        t = time.perf_counter()
        got = go()
        how = ""
        if isinstance(got, GenerationResult) and got.cached_tokens:
            how = f" ({got.cached_tokens} tokens from the {got.cache_tier} tier)"
        log.info("warm-up %d of %d: %s in %.1f s%s", i, len(steps), what,
                 time.perf_counter() - t, how)
    if stats is not None:  # (not a user's request: its hits and misses are not counted)
        for f in dataclasses.fields(stats):
            setattr(coord.cache.stats, f.name, getattr(stats, f.name))
    seconds = time.perf_counter() - t0
    log.info("warm-up requests done in %.1f s", seconds)
    return seconds


def _restore_prompt(coord: Coordinator) -> list[int] | None:
    """The tokens of the most recently used disk-cache entry (a whole-prompt hit: its file's
    `tokens`, checked by the restore itself), or None."""
    cache = coord.cache
    if cache is None:
        return None
    on_disk = [e for e in cache.index.entries.values() if e.path is not None and not e.in_ram]
    if not on_disk:
        return None
    leaf = max(on_disk, key=lambda e: (e.last_used, e.length))
    if leaf.length + 2 > coord.config.max_context:
        return None
    try:
        layout = read_layout(leaf.path)
        t = layout.tensors.get("tokens")
        if t is None or t.shape != (leaf.length,):
            return None
        with open(leaf.path, "rb") as f:
            f.seek(layout.offset("tokens"))
            return np.frombuffer(f.read(t.nbytes), dtype="<i4").tolist()
    except (OSError, KVFileError) as e:  # (the restore would miss: nothing to warm)
        log.info("warm-up: no restore from disk (%s: %s)", leaf.path.name, e)
        return None
