"""Which shard holds which layers on which device, checked before any process starts."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re

from layersplit.runtime.config import ConfigError, RuntimeConfig

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


def bytes_split(costs: list[int], shards: int, first: int = 0, last: int = 0) -> list[int]:
    """Layers per shard for contiguous ranges whose largest byte total is the smallest it can
    be: `costs[i]` = bytes of layer i, `first` / `last` = bytes only the first / last shard
    holds (the embedding; the final norm and LM head). Ties go to the earliest split."""
    n = len(costs)
    if not 1 <= shards <= n:
        raise PlacementError(f"{shards} shards for {n} layers")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> int:  # bytes of the shard holding layers [a, b)
        return prefix[b] - prefix[a] + (first if a == 0 else 0) + (last if b == n else 0)

    inf = float("inf")
    # best[k][b]: the smallest largest shard over layers [0, b) in k shards; cut: where it starts
    best = [[inf] * (n + 1) for _ in range(shards + 1)]
    cut = [[0] * (n + 1) for _ in range(shards + 1)]
    best[0][0] = 0
    for k in range(1, shards + 1):
        for b in range(k, n + 1):
            for a in range(k - 1, b):
                v = max(best[k - 1][a], cost(a, b))
                if v < best[k][b]:
                    best[k][b], cut[k][b] = v, a
    counts, b = [], n
    for k in range(shards, 0, -1):
        a = cut[k][b]
        counts.append(b - a)
        b = a
    return counts[::-1]


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


def plan(cfg: RuntimeConfig, num_layers: int,
         layer_bytes: tuple[list[int], int, int] | None = None) -> Placement:
    """The placement of `cfg`. `layer_bytes` ((bytes per layer), first-only bytes, last-only
    bytes; `shards.weights.layer_bytes`) is needed for `split = "auto"`."""
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
        if cfg.split == "auto":
            if layer_bytes is None:
                raise PlacementError("split = auto needs the model's layer sizes")
            counts = bytes_split(layer_bytes[0], n, layer_bytes[1], layer_bytes[2])
        elif isinstance(cfg.split, str):
            raise PlacementError(f"split {cfg.split!r}: give layer counts (e.g. 15,15) or auto")
        elif cfg.split is not None:
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


def describe_split(p: Placement, sizes: tuple[list[int], int, int]) -> str:
    """Each shard's layers and weight bytes, e.g. `0:20 on cuda:0 (5.1 GB), ...`."""
    costs, first, last = sizes
    parts = []
    for s in p.shards:
        total = sum(costs[s.start:s.end]) + (first if s.start == 0 else 0) + \
            (last if s.end == len(costs) else 0)
        size = f"{total / 1e9:.2f} GB" if total >= 1e9 else f"{total / 1e6:.1f} MB"
        parts.append(f"{s.layers} on {s.device} ({size})")
    return ", ".join(parts)


def check_local_devices(p: Placement) -> None:
    """Local CUDA devices must exist (checked before spawning anything)."""
    local_cuda = [s.device for s in p.shards if s.address is None and s.device.startswith("cuda")]
    if not local_cuda:
        return
    quick = visible_cuda_devices()
    if quick is not None and all(int(d.split(":")[1]) < quick for d in local_cuda):
        return
    count = cuda_device_count()  # (a no is the driver's, never the quick count's)
    for d in local_cuda:
        if int(d.split(":")[1]) >= count:
            raise PlacementError(f"device {d} does not exist here ({count} CUDA devices visible); "
                                 "fix devices or CUDA_VISIBLE_DEVICES")


def visible_cuda_devices() -> int | None:
    """The CUDA devices this process sees, counted without the driver: NVIDIA's GPUs under
    /proc/driver/nvidia/gpus, less what `CUDA_VISIBLE_DEVICES` hides (its leading distinct
    indices below that count, where CUDA stops). None where that is not known so: no such
    folder, UUIDs (`GPU-`, `MIG-`: which of them name a device only the driver knows) or an
    index named twice (CUDA then sees none). Asking the driver (`cuInit`) took ~1.5 s of the
    coordinator's start on an H200 host, before any shard had its arguments, so only a device
    this count does not find is asked about (`check_local_devices`); where it counts one the
    driver would not (a GPU in MIG mode), the shard's own start fails on it instead."""
    try:
        gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    seen: set[int] = set()
    for item in (x.strip() for x in visible.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            return None
        if not re.fullmatch(r"[0-9]+", item) or int(item) >= gpus:
            break  # (CUDA stops at the first entry that names no device)
        if int(item) in seen:
            return None
        seen.add(int(item))
    return len(seen)


def cuda_device_count() -> int:
    """The CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applies), asked of the driver
    library itself, not of torch (the coordinator imports no torch otherwise). Where there is no
    CUDA driver library (ROCm names its HIP devices `cuda` too) torch counts them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0  # (no device, or a driver that cannot run: torch would see none either)
    return count.value
