"""Which shard holds which layers on which device, checked before any process starts."""

from __future__ import annotations

import dataclasses
import re

from runtime.config import ConfigError, RuntimeConfig

DEVICE_RE = re.compile(r"^(cpu|cuda:\d+)$")
TRANSPORTS = ("auto", "cuda-ipc", "shm", "zmq")


class PlacementError(ConfigError):
    """An invalid placement; the message says what to change."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    index: int
    start: int
    end: int
    device: str
    address: str | None  # a remote shard's address; None = start it here

    @property
    def layers(self) -> str:
        return f"{self.start}:{self.end}"


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    shards: tuple[ShardPlan, ...]
    transports: tuple[str, ...]  # one per edge shard i -> i+1


def normalize_device(d: str) -> str:
    d = d.strip().lower()
    if d == "cuda":
        d = "cuda:0"
    if not DEVICE_RE.match(d):
        raise PlacementError(
            f"unknown device {d!r}: use cpu or cuda:N (ROCm GPUs are cuda:N in torch too)"
        )
    return d


def even_split(num_layers: int, shards: int) -> list[int]:
    base, extra = divmod(num_layers, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def weighted_split(num_layers: int, weights: tuple[float, ...]) -> list[int]:
    if any(w <= 0 for w in weights):
        raise PlacementError(f"weights {list(weights)}: every weight must be > 0")
    total = sum(weights)
    exact = [num_layers * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > num_layers:  # take from the largest share that can give
        i = max((i for i, c in enumerate(counts) if c > 1), key=lambda i: counts[i] - exact[i])
        counts[i] -= 1
    while sum(counts) < num_layers:  # largest remainder first
        i = max(range(len(counts)), key=lambda i: exact[i] - counts[i])
        counts[i] += 1
    return counts


def _ranges_from_strings(specs: tuple[str, ...], num_layers: int) -> list[tuple[int, int]]:
    ranges = []
    for s in specs:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", s)
        if not m:
            raise PlacementError(f"layer range {s!r}: write it as START:END, e.g. 0:15")
        a, b = int(m.group(1)), int(m.group(2))
        if a >= b:
            raise PlacementError(f"layer range {s!r} is empty: END must be greater than START")
        ranges.append((a, b))
    ordered = sorted(ranges)
    if ordered != ranges:
        raise PlacementError(f"layer ranges {list(specs)} must be listed in order")
    pos = 0
    for a, b in ranges:
        if a < pos:
            raise PlacementError(f"layer ranges overlap: {a}:{b} starts before layer {pos}, "
                                 f"where the previous range ends")
        if a > pos:
            raise PlacementError(f"layers {pos}:{a} are not covered by any shard")
        pos = b
    if pos < num_layers:
        raise PlacementError(f"layers {pos}:{num_layers} are not covered by any shard")
    if pos > num_layers:
        raise PlacementError(f"layer range ends at {pos}, but the model has {num_layers} layers")
    return ranges


def plan(cfg: RuntimeConfig, num_layers: int) -> Placement:
    devices = [normalize_device(d) for d in cfg.devices]
    n = len(devices)
    if n > num_layers:
        raise PlacementError(f"{n} shards but the model has only {num_layers} layers: "
                             f"use at most {num_layers} devices")
    given = [k for k in ("split", "layers", "weights") if getattr(cfg, k) is not None]
    if len(given) > 1:
        raise PlacementError(f"give only one of split / layers / weights (got {', '.join(given)})")
    if cfg.layers is not None:
        if len(cfg.layers) != n:
            raise PlacementError(f"{len(cfg.layers)} layer ranges for {n} devices")
        ranges = _ranges_from_strings(cfg.layers, num_layers)
    else:
        if cfg.split is not None:
            counts = list(cfg.split)
            if len(counts) != n:
                raise PlacementError(f"split has {len(counts)} entries for {n} devices: give one "
                                     "layer count per device")
            if any(c < 1 for c in counts):
                raise PlacementError(f"split {counts}: every shard needs at least 1 layer")
            if sum(counts) != num_layers:
                raise PlacementError(f"split {counts} adds up to {sum(counts)} layers; the model "
                                     f"has {num_layers}")
        elif cfg.weights is not None:
            if len(cfg.weights) != n:
                raise PlacementError(f"{len(cfg.weights)} weights for {n} devices")
            counts = weighted_split(num_layers, cfg.weights)
        else:
            counts = even_split(num_layers, n)
        ranges, pos = [], 0
        for c in counts:
            ranges.append((pos, pos + c))
            pos += c
    addresses: list[str | None] = [None] * n
    if cfg.shard_addresses:
        if len(cfg.shard_addresses) != n:
            raise PlacementError(f"shard_addresses has {len(cfg.shard_addresses)} entries for {n} "
                                 "devices ('' for a shard started here)")
        for i, a in enumerate(cfg.shard_addresses):
            if a and not a.startswith("tcp://"):
                raise PlacementError(f"shard address {a!r}: remote shards listen on tcp://HOST:PORT")
            addresses[i] = a or None
    edges = max(n - 1, 0)
    transports = list(cfg.transport)
    if len(transports) == 1:
        transports = transports * edges
    if len(transports) != edges:
        raise PlacementError(f"transport has {len(cfg.transport)} entries; give one, or one per "
                             f"edge ({edges})")
    for i, t in enumerate(transports):
        if t not in TRANSPORTS:
            raise PlacementError(f"transport {t!r} is unknown: use one of {', '.join(TRANSPORTS)}")
        a, b = devices[i], devices[i + 1]
        if t == "cuda-ipc" and not (a.startswith("cuda") and b.startswith("cuda")):
            raise PlacementError(f"edge {i}->{i + 1}: cuda-ipc needs two CUDA devices, got {a} "
                                 f"and {b}; use shm or auto")
        if t in ("cuda-ipc", "shm") and (addresses[i] or addresses[i + 1]):
            raise PlacementError(f"edge {i}->{i + 1}: {t} needs both shards on this host; use zmq "
                                 "or auto for remote shards")
    shards = tuple(ShardPlan(i, a, b, devices[i], addresses[i]) for i, (a, b) in enumerate(ranges))
    return Placement(shards, tuple(transports))


def check_local_devices(p: Placement) -> None:
    """Local CUDA devices must exist (checked before spawning anything)."""
    local_cuda = [s.device for s in p.shards if s.address is None and s.device.startswith("cuda")]
    if not local_cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in local_cuda:
        if int(d.split(":")[1]) >= count:
            raise PlacementError(f"device {d} does not exist here ({count} CUDA devices visible); "
                                 "fix devices or CUDA_VISIBLE_DEVICES")
