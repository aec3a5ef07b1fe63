"""The host tier of live KV on a GPU: one sequence's blocks swapped out to host memory
and back through `shards.host_kv.HostKVPool` (page-locked buffers, a copy stream, the host not
waiting), next to the synchronous pageable copy it replaced, measured in the same run.

    python bench/kv_swap.py --tokens 8192,32768 --repeats 3

For each size: the host time until `swap_out` / `swap_in` returns (what the shard's handler,
and so the coordinator, waits for), the time until the copies have run, and the bus rate;
the old path's times (`k.copy_(k_store[:, blocks])` into plain memory, and back, synchronous);
and that the rows came back bit for bit. The device blocks are scattered (every other one), as
a pool's are after a while. Shape: Qwen3-8B's KV (36 layers, 8 KV heads of 128), bf16, blocks
of 16 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.host_kv import HostKVPool  # noqa: E402
from layersplit.shards.kv_cache import KVLayout  # noqa: E402
from layersplit.shards.paged_kv import PagedKVCache  # noqa: E402

BLOCK = 16


def timed(fn) -> tuple[float, float]:
    """(seconds until fn returns, seconds until the device is idle after it)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t0


def old_out(kv: PagedKVCache, dev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The path before: synchronous copies into plain (pageable) memory."""
    shape = (kv.k_store.shape[0], len(dev), *kv.k_store.shape[2:])
    k, v = torch.empty(shape, dtype=kv.k_store.dtype), torch.empty(shape, dtype=kv.v_store.dtype)
    k.copy_(kv.k_store[:, dev])
    v.copy_(kv.v_store[:, dev])
    return k, v


def old_in(kv: PagedKVCache, dev: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    kv.k_store[:, dev] = k.to(kv.device)
    kv.v_store[:, dev] = v.to(kv.device)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    most = max(sizes) // BLOCK
    layout = KVLayout(36, 8, 128, torch.bfloat16)
    kv = PagedKVCache(layout, BLOCK * 2 * most, 1, 2 * most + 2, BLOCK, "cuda:0")
    kv.k_store.normal_()
    kv.v_store.normal_()
    host = HostKVPool(kv, most)
    print(f"{torch.cuda.get_device_name()}; block {host.block_bytes / 2**20:.2f} MB "
          f"(K and V, 36 layers); staging {host.stage_blocks} blocks", flush=True)
    print("tokens    GB | new: out returns / done, in returns / done, GB/s out/in | "
          "old: out, in, GB/s out/in")
    for n_tok in sizes:
        n = n_tok // BLOCK
        src = list(range(0, 2 * n, 2))  # scattered, as a pool's blocks are
        dst = list(range(1, 2 * n + 1, 2))
        gb = n * host.block_bytes / 1e9
        want_k, want_v = kv.k_store[:, src].clone(), kv.v_store[:, src].clone()
        rows = []
        for _ in range(args.repeats):
            out = timed(lambda: host.swap_out(kv, [[d, h] for h, d in enumerate(src)]))
            back = timed(lambda: host.swap_in(kv, [[d, h] for h, d in enumerate(dst)]))
            ok = torch.equal(kv.k_store[:, dst], want_k) and \
                torch.equal(kv.v_store[:, dst], want_v)
            torch.cuda.synchronize()
            host.reap()
            dev, back_to = (torch.tensor(b, device="cuda:0") for b in (src, dst))
            held: list = []
            o_out = timed(lambda: held.append(old_out(kv, dev)))
            o_in = timed(lambda: old_in(kv, back_to, *held[0]))
            held.clear()
            rows.append((out, back, o_out, o_in, ok))
        med = [statistics.median(r[i][j] for r in rows) for i in range(4) for j in range(2)]
        print(f"{n_tok:6d} {gb:5.2f} | {med[0]:.3f} / {med[1]:.3f} s, {med[2]:.3f} / "
              f"{med[3]:.3f} s, {gb / med[1]:.1f}/{gb / med[3]:.1f} | {med[5]:.3f} s, "
              f"{med[7]:.3f} s, {gb / med[5]:.1f}/{gb / med[7]:.1f}; rows equal: "
              f"{all(r[4] for r in rows)}; runs (new out done): "
              + ", ".join(f"{r[0][1]:.3f}" for r in rows), flush=True)
    host.close()


if __name__ == "__main__":
    main()
