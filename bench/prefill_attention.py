"""A prefill chunk's attention over its cached prefix: flash attention's lower-right causal form
against cuDNN's attention split in two and merged (`shards.layers.attention`), milliseconds
and TFLOP/s of one layer, Qwen3-8B's heads (32 query heads, 8 KV heads of 128), bf16.

    python bench/prefill_attention.py [--chunks 2048,8192] [--prefix 0,2048,4096,8192,32768,122880]

- `flash`: `_flash_lower_right` (GQA K/V as they are);
- `cudnn split`: `_cudnn_split`, the chunk over the prefix (no mask) and over itself (causal),
  merged by their log-sum-exps (at prefix 0, one causal call);
Each is the median of 5 timed calls after a first call; `1st ms` is that first call's wall time
(every row is a shape this process has not met: what a chat's chunk, whose lengths end at
message boundaries, pays at each chunk, cuDNN building a graph for it). `max|diff|` is cuDNN's
distance from flash; values are drawn so that the prefix's and the chunk's parts differ (a wrong
merge shows). The server takes the split only where `LAYERSPLIT_CUDNN_PREFILL` asks for it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.layers import attention  # noqa: E402

H, G, D = 32, 8, 128


def timed(fn, reps: int = 5) -> tuple[float, float, torch.Tensor]:
    """(median ms of `reps` calls, ms of the first call, the output)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2], first, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--prefix", default="0,2048,4096,8192,32768,122880")
    args = ap.parse_args()
    dev, dt = "cuda:0", torch.bfloat16
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}")
    print(f"{'chunk':>6} {'prefix':>7} {'flash ms':>9} {'1st ms':>8} {'TFLOP/s':>8} "
          f"{'cudnn ms':>9} {'1st ms':>8} {'TFLOP/s':>8} {'speed-up':>8}  max|diff|")
    for n in [int(x) for x in args.chunks.split(",")]:
        for p in [int(x) for x in args.prefix.split(",")]:
            torch.manual_seed(0)
            t = p + n
            q = torch.randn(n, H, D, device=dev, dtype=dt)
            k = torch.randn(t, G, D, device=dev, dtype=dt)
            v = torch.randn(t, G, D, device=dev, dtype=dt)
            v[:p] += 1.0  # the prefix's values and the chunk's differ on average
            flops = 4 * n * (p + n / 2) * H * D
            args3 = (q, k, v)
            if p == 0:
                fl = cu = lambda a=args3: attention.attend(*a, None, True)  # noqa: E731
            else:
                fl = lambda a=args3: attention._flash_lower_right(*a, None)  # noqa: E731
                cu = lambda a=args3: attention._cudnn_split(*a, None)  # noqa: E731
            ms_f, first_f, ref = timed(fl)
            ms_c, first_c, out = timed(cu)
            diff = float((out.float() - ref.float()).abs().max())
            print(f"{n:>6} {p:>7} {ms_f:>9.2f} {first_f:>8.1f} {flops / ms_f / 1e9:>8.0f} "
                  f"{ms_c:>9.2f} {first_c:>8.1f} {flops / ms_c / 1e9:>8.0f} {ms_f / ms_c:>8.2f}  "
                  f"{diff:.3g}", flush=True)
            del q, k, v, args3, fl, cu, ref, out
            torch.cuda.empty_cache()
    print(f"cuDNN took GQA K/V as they are: {attention._CUDNN.get('gqa')}; by head dim: "
          f"{ {k: v for k, v in attention._CUDNN.items() if k != 'gqa'} }")


if __name__ == "__main__":
    main()
