"""The greedy draw of one row of float32 logits: torch's (`max`, `isfinite`, `masked_fill`)
against `kernels.row_argmax`'s two launches, microseconds of GPU time per draw (a CUDA graph of
24 draws over 12 rows in turn, replayed 100 times: `moe_kernel_sweep.time_us`).

    python bench/argmax_time.py [--vocab 102400,128256,151936] [--rows 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.kernels.row_argmax import row_argmax  # noqa: E402

from bench.moe_kernel_sweep import time_us  # noqa: E402


def torch_draw(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, ids = rows.max(dim=-1)
    return ids, ids.masked_fill(~torch.isfinite(top), -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="102400,128256,151936")
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    for v in (int(x) for x in args.vocab.split(",")):
        logits = [torch.randn(args.rows, v, device="cuda:0") for _ in range(12)]
        t_torch = time_us(lambda j: torch_draw(logits[j]))
        t_ours = time_us(lambda j: row_argmax(logits[j]))
        print(f"vocab {v}, {args.rows} row(s): torch {t_torch:.1f} us, row_argmax "
              f"{t_ours:.1f} us")


if __name__ == "__main__":
    main()
