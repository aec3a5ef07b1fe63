"""How many blocks each shard's paged KV pool holds (`configure`'s `kv_blocks`).

Block ids are global (`runtime.block_manager`), so every shard's pool has the same number of
blocks: the fewest that any shard's share holds. With `kv_blocks` set, that many; with
`kv_cache_gb`, as many as the shard with the most KV bytes per block (the most attention layers)
fits in that many GiB; with neither, `max_seqs x max_context` tokens, the capacity of the
contiguous slots this pool replaced (nothing that ran before is refused now).

The host tier (`kv_host_pool_blocks`, swap preemption in `runtime.batching`) has as many
blocks on every shard too: `kv_host_blocks`, or what `kv_host_gb` holds on the most loaded
shard, or by default a quarter of the device pool's blocks, at most `HOST_DEFAULT_GB` GiB.

Host memory (`host_pool_plan`, the ledger `runtime.host_pool.HostPool`): with `host_cache_gb`
every shard has that many GiB for swapped-out sequences and the RAM tier together (as many
host block ids as the most loaded shard's budget holds; no RAM-tier cap of its own). Without
it, the two budgets of before sit side by side in one pool: each shard's capacity is its host
KV blocks' bytes plus `cache_ram_gb`, and the RAM tier keeps `cache_ram_gb` as its own cap, so
neither ever takes the other's room (a swap-out never evicts a snapshot).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.placement import Placement

HOST_DEFAULT_GB = 4.0  # the default host tier's cap per shard


def attention_layers(model_config: Any, start: int, end: int) -> int:
    """Layers of [start, end) that keep KV rows (a hybrid model's linear layers keep none)."""
    spec = getattr(model_config, "hybrid", None)
    if spec is None:
        return end - start
    return sum(1 for i in range(start, end) if not spec.is_linear(i))


def block_bytes(model_config: Any, layers: int, block: int, itemsize: int) -> int:
    """Bytes of one block (K and V) of `layers` layers."""
    return block * model_config.kv_bytes_per_token(layers, itemsize)


def kv_pool_blocks(config: RuntimeConfig, model_config: Any, placement: Placement,
                   itemsize: int) -> int:
    if config.kv_blocks:
        return config.kv_blocks
    if not config.kv_cache_gb:
        return config.max_seqs * -(-config.max_context // config.kv_block)
    budget = int(config.kv_cache_gb * 2**30)
    most = max(block_bytes(model_config, attention_layers(model_config, s.start, s.end),
                           config.kv_block, itemsize) for s in placement.shards)
    blocks = budget // max(most, 1)
    if blocks < 1:
        raise ConfigError(f"kv_cache_gb={config.kv_cache_gb}: less than one KV block "
                          f"({most} bytes on the most loaded shard); raise it")
    return blocks


def kv_host_pool_blocks(config: RuntimeConfig, model_config: Any, placement: Placement,
                        itemsize: int, device_blocks: int) -> int:
    """Blocks of each shard's host KV pool (0: no swap preemption)."""
    if config.kv_host_blocks is not None:
        return config.kv_host_blocks
    most = max(block_bytes(model_config, attention_layers(model_config, s.start, s.end),
                           config.kv_block, itemsize) for s in placement.shards)
    if config.kv_host_gb is not None:
        blocks = int(config.kv_host_gb * 2**30) // max(most, 1)
        if config.kv_host_gb and blocks < 1:
            raise ConfigError(f"kv_host_gb={config.kv_host_gb}: less than one KV block "
                              f"({most} bytes on the most loaded shard); raise it or use 0")
        return blocks
    return min(max(1, device_blocks // 4), int(HOST_DEFAULT_GB * 2**30) // max(most, 1))


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """Each shard's host memory (`runtime.host_pool.HostPool`)."""

    blocks: int  # host block ids (the most swapped blocks at once; 0: no swap preemption)
    capacity: tuple[int, ...]  # bytes per shard, swapped blocks and snapshots together
    block_bytes: tuple[int, ...]  # bytes of one swapped block on each shard
    ram_cap: int | None  # the RAM tier's own cap (bytes, all shards), None: the pool's alone


def host_pool_plan(config: RuntimeConfig, model_config: Any, placement: Placement,
                   itemsize: int, device_blocks: int) -> HostPlan:
    """How much host memory each shard gives swapped-out sequences and the RAM tier."""
    per = tuple(block_bytes(model_config, attention_layers(model_config, s.start, s.end),
                            config.kv_block, itemsize) for s in placement.shards)
    hybrid = getattr(model_config, "hybrid", None) is not None  # (its state is not in blocks)
    if config.host_cache_gb is not None:
        budget = int(config.host_cache_gb * 2**30)
        blocks = 0 if hybrid else budget // max(max(per), 1)
        return HostPlan(blocks, (budget,) * len(per), per, None)
    blocks = 0 if hybrid else kv_host_pool_blocks(config, model_config, placement, itemsize,
                                                  device_blocks)
    ram = int(config.ram_tier_gb * 2**30)
    return HostPlan(blocks, tuple(blocks * b + ram for b in per), per, ram)
