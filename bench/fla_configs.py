"""Tune fla-core's kernels for the hybrid models' linear-attention shapes on this GPU, and write
the launch configs its autotune chose where `shards/kernels/fla_loading.py` ships them
(`shards/kernels/fla_configs/<GPU name>/`, fla-core's own config-file layout), so that a cold
start on the same GPU model compiles one config a kernel instead of timing every candidate.

    python3 bench/fla_configs.py --heads 16x48,16x32,16x16 --lengths 64,1024,8192

Each (key heads x value heads) pair runs a Qwen3.5 linear-attention layer (`GatedDeltaNet`,
random weights, head widths 128, conv width 4) through the prefill path a shard runs, a chunk
of each length, in each dtype, one sequence. The keys fla tunes by are mostly head counts,
widths, block sizes and dtypes; a few hold the batch (`chunk_local_cumsum_scalar_kernel`'s B)
or a count of row blocks (`l2norm_fwd_kernel`'s NB: batch x length x key heads / 65,536), so
chunks longer than the lengths tuned here, or several sequences' prefill in one launch, still
autotune those. Entries merge into the files there (other keys stay). FLA_CACHE_MODE=disabled
is set for the run (any value you set is refused): fla times every candidate again rather than
reading configs from files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.hybrid_prewarm import build_layer, prewarm_layer  # noqa: E402
from layersplit.shards.kernels import fla_loading  # noqa: E402
from layersplit.shards.kernels.gated_delta_fla import delta_rules  # noqa: E402


def run_layer(hk: int, hv: int, lengths: list[int], dtype: str, dev: str) -> None:
    """A prefill chunk of each length through a random `GatedDeltaNet` of these heads
    (`shards.hybrid_prewarm`'s, as a shard's first start compiles them)."""
    shape = {"hidden_size": 256, "num_k_heads": hk, "num_v_heads": hv, "head_k_dim": 128,
             "head_v_dim": 128, "conv_kernel": 4, "eps": 1e-6, "fused_projections": False,
             "dtype": dtype, "fuse": False}
    prewarm_layer(build_layer(shape, torch.device(dev)), tuple(lengths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16x48,16x32,16x16",
                    help="key heads x value heads, comma-separated")
    ap.add_argument("--lengths", default="64,1024,8192")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None,
                    help="the folder to merge into (default: the one shipped for this GPU)")
    args = ap.parse_args()
    if os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled":
        sys.exit(f"FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']}: this tunes, it does not read "
                 "configs; unset it")
    os.environ["FLA_CACHE_MODE"] = "disabled"  # (fla-core is imported below)
    torch.cuda.set_device(args.device)
    if delta_rules(args.device) is None:
        sys.exit("fla-core's kernels do not run here (see the warning above)")
    gpu = torch.cuda.get_device_name(args.device)
    lengths = [int(n) for n in args.lengths.split(",")]
    for dtype in args.dtypes.split(","):
        for pair in args.heads.split(","):
            hk, hv = (int(x) for x in pair.split("x"))
            t0 = time.perf_counter()
            run_layer(hk, hv, lengths, dtype, args.device)
            print(f"{gpu}: {hk} x {hv} heads, {dtype}: tuned in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    out = Path(args.out) if args.out else fla_loading.CONFIGS / fla_loading.gpu_dir_name(gpu)
    files = fla_loading.config_files()
    n = fla_loading.write_config_files(files, out)
    print(f"{n} configs of {len(files)} kernels written to {out}")


if __name__ == "__main__":
    main()
