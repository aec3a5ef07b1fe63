"""One MLA layer's attention stage in a decode step (the absorbed form, `shards.layers.mla`),
next to the floor of the bytes it reads: the latent rows of its keys and its weights. Both
paths: the torch form (`LAYERSPLIT_MLA_KERNEL=0`) and the Triton kernels
(`shards.kernels.mla_decode`, `mla_step`), the input projections fused as a shard fuses them and
the one-row projections through the GEMV kernel as a shard runs them (since 2026-12-01; cuBLAS's
before, ~12 us of a layer's stage).

    python bench/mla_attention.py [--keys 2048,8192,32768] [--device cuda:0] [--profile]
        [--split-keys 32,128] [--warps 4,8] [--block-keys 32,64] [--stages 2,4]
        [--per-sm 1,2,4] [--combine 32:4,64:8]   (the kernel's keys per
        split and warps per program, each pair measured, and the combine's latent columns and
        warps per program, each with the default pair; default their own)

The DeepSeek-V2-Lite-width MLA shape (configs/models/deepseek-v2-lite-shape: 16 heads, a
512 + 64 latent, no q bottleneck), bfloat16, random weights and rows, over a paged cache (blocks
of 16 in shuffled order, as a shard's pool). A step runs `--layers` distinct layers (their
weights and KV rows apart, so they come from HBM, not L2) captured in one CUDA graph; the time
per layer is the median of `--repeats` replays over the layers. Floor: (keys x latent row bytes
+ the layer's attention weights) over the copy bandwidth measured now (read + write of a 1 GiB
copy, as bench/moe.py's floor). On a CPU it runs eagerly, once, as a check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.kv_cache import KVLayout  # noqa: E402
from layersplit.shards.layers import mla as mla_layers  # noqa: E402
from layersplit.shards.layers.gemv_linear import linears_as_gemv  # noqa: E402
from layersplit.shards.layers.mla import MLA_KERNEL_SWITCH, MLAttention  # noqa: E402
from layersplit.shards.layers.rotary import rope_cos_sin, rope_inv_freq  # noqa: E402
from layersplit.shards.layers.step import StepInfo  # noqa: E402
from layersplit.shards.model_config import read_hf_config  # noqa: E402
from layersplit.shards.paged_kv import PagedKVCache  # noqa: E402

from bench.decode import copy_bandwidth  # noqa: E402

SHAPE = Path(__file__).resolve().parents[1] / "configs" / "models" / "deepseek-v2-lite-shape"
BLOCK = 16


def measure_keys(args, path: str) -> list[dict]:
    """A row of `path` (the setting measured) at each of `--keys`."""
    return [{"path": path, **measure(args, int(k))} for k in args.keys.split(",")]


def measure(args, keys: int) -> dict:
    """One row; where the kernel was asked for and failed to build (a launch shape Triton
    refuses), the layers turned it off for the process (`shards.layers.mla`): the row says so,
    and the next one asks again."""
    row = _measure(args, keys)
    if os.environ.get(MLA_KERNEL_SWITCH) == "1" and mla_layers._KERNEL.pop("off", False):
        row["failed"] = "the kernel did not build: the torch form ran"
    return row


def _measure(args, keys: int) -> dict:
    cfg = read_hf_config(SHAPE)
    dev, dtype = torch.device(args.device), torch.bfloat16
    if dev.type == "cpu":
        dtype = torch.float32
    layers = [MLAttention(cfg).to(dev, dtype) for _ in range(args.layers)]
    for a in layers:
        for p in a.parameters():
            p.data.normal_(0.0, 0.02)
        if dev.type == "cuda":
            a.fuse()  # (as a shard's layers: `fuse_projections`; one-row projections through
            linears_as_gemv(a)  # the GEMV kernel, as `fuse_projections` sets an unfused layer)
    blocks = -(-(keys + 1) // BLOCK)
    kv = PagedKVCache(KVLayout(args.layers, *cfg.kv_row, dtype), blocks * BLOCK, 1, blocks,
                      BLOCK, dev)
    kv.k_store.normal_()
    kv.v_store.normal_()
    kv.set_table(0, 0, torch.randperm(blocks).tolist())
    inv = rope_inv_freq(cfg).to(dev)
    x = torch.randn(1, cfg.hidden_size, device=dev, dtype=dtype)
    pos = torch.tensor([keys], device=dev)  # the new row is key `keys`: keys + 1 attended

    def step() -> torch.Tensor:
        s = StepInfo.static(pos, 1, keys + 1)
        cos, sin = rope_cos_sin(inv, s.positions, dtype)
        out = x
        for i, a in enumerate(layers):
            out = a(x, cos, sin, kv, i, 0, s)
        return out

    weight_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    row_bytes = 2 * cfg.kv_row[1] * torch.empty((), dtype=dtype).element_size()
    row = {"keys": keys, "layers": args.layers, "kv_bytes": (keys + 1) * row_bytes,
           "weight_bytes": weight_bytes}
    if dev.type != "cuda":
        with torch.inference_mode():
            step()
        return row
    with torch.inference_mode():
        for _ in range(2):
            step()  # (warm-up: cuBLAS handles, allocator)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        times = []
        for _ in range(args.repeats):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / args.layers)
        if args.profile:  # (the graph's kernels, a replay's 27 layers each; `kernels` prints)
            from bench.profile_draft import kernels

            print(f"--- {'kernel' if os.environ[MLA_KERNEL_SWITCH] == '1' else 'torch'}, "
                  f"{keys} keys, {args.layers} layers a replay")
            row.update(kernels(f"stage_{keys}", graph.replay, dev, rows=12))
    per_layer = statistics.median(times)
    bw = copy_bandwidth(args.device)  # (the other benches' floor: HBM read + write together)
    floor = (row["kv_bytes"] + weight_bytes) / bw
    row.update(us_per_layer=per_layer * 1e6, floor_us=floor * 1e6, of_floor=floor / per_layer,
               copy_GBps=bw / 1e9)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="2048,8192,32768")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--split-keys", default=None,
                    help="the kernel's keys per split, comma-separated (default: SPLIT_KEYS_ALONE)")
    ap.add_argument("--warps", default=None,
                    help="the kernel's warps per program, comma-separated (default: LAUNCH's)")
    ap.add_argument("--block-keys", default=None,
                    help="the kernel's keys per block of its loop, comma-separated, each "
                         "measured with the default split and warps")
    ap.add_argument("--stages", default=None,
                    help="the kernel's pipeline stages, comma-separated, each measured with "
                         "the default split and warps")
    ap.add_argument("--per-sm", default=None,
                    help="the programs an SM holds, for the key splits' fill, comma-separated, "
                         "each measured with the default split and warps")
    ap.add_argument("--combine", default=None,
                    help="the combine's columns:warps per program, comma-separated (default: "
                         "COMBINE's), each measured with the default split and warps")
    ap.add_argument("--profile", action="store_true",
                    help="print each graph's kernel table (the torch profiler, 10 replays)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from layersplit.shards.kernels import mla_decode

    rows = []
    os.environ[MLA_KERNEL_SWITCH] = "0"
    rows += measure_keys(args, "torch")
    os.environ[MLA_KERNEL_SWITCH] = "1"
    default = (mla_decode.SPLIT_KEYS_ALONE, mla_decode.LAUNCH["num_warps"])  # (batch 1's)
    saved_split = mla_decode.SPLIT_KEYS
    for split in (args.split_keys or str(default[0])).split(","):
        for warps in (args.warps or str(default[1])).split(","):
            mla_decode.SPLIT_KEYS = mla_decode.SPLIT_KEYS_ALONE = int(split)
            mla_decode.LAUNCH["num_warps"] = int(warps)
            path = "kernel" if (int(split), int(warps)) == default else \
                f"kernel, splits of {split}, {warps} warps"
            rows += measure_keys(args, path)
    mla_decode.SPLIT_KEYS_ALONE, mla_decode.LAUNCH["num_warps"] = default
    mla_decode.SPLIT_KEYS = saved_split
    for block in (args.block_keys.split(",") if args.block_keys else []):
        saved, mla_decode.BLOCK_N = mla_decode.BLOCK_N, int(block)
        rows += measure_keys(args, f"kernel, blocks of {block} keys")
        mla_decode.BLOCK_N = saved
    saved = mla_decode.LAUNCH["num_stages"]
    for stages in (args.stages.split(",") if args.stages else []):
        mla_decode.LAUNCH["num_stages"] = int(stages)
        rows += measure_keys(args, f"kernel, {stages} stages")
    mla_decode.LAUNCH["num_stages"] = saved
    saved = mla_decode.LAUNCH["per_sm"]
    for per_sm in (args.per_sm.split(",") if args.per_sm else []):
        mla_decode.LAUNCH["per_sm"] = int(per_sm)
        rows += measure_keys(args, f"kernel, a fill of {per_sm} programs an SM")
    mla_decode.LAUNCH["per_sm"] = saved
    combine = dict(mla_decode.COMBINE)
    for pair in (args.combine.split(",") if args.combine else []):
        cols, warps = (int(v) for v in pair.split(":"))
        mla_decode.COMBINE.update(cols=cols, num_warps=warps)
        rows += measure_keys(args, f"kernel, combine {cols} columns, {warps} warps")
    mla_decode.COMBINE.update(combine)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| path | keys | us per layer | floor us | of floor |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['path']} | {r['keys']} | ({r['failed']}) | - | - |")
        elif "us_per_layer" in r:
            print(f"| {r['path']} | {r['keys']} | {r['us_per_layer']:.1f} | "
                  f"{r['floor_us']:.1f} | {r['of_floor']:.0%} |")
        else:
            print(f"| {r['path']} | {r['keys']} | (ran on {args.device}: no timing) | - | - |")


if __name__ == "__main__":
    main()
