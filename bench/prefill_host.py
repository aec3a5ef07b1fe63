"""Host cost of one eager prefill step of a shard's layer range, on a model so narrow that its
arithmetic is negligible: the wall time of a few-row step after a cached prefix is the host's
(Python and torch dispatch). Prints the median step time, the time per layer, and with
`--profile` the aten ops of one step grouped by name (counts per layer).

`--gpu-path` runs the layers as a GPU shard does (`FusedDecode.prefill`: fused projections, the
row kernels around attention), the Triton row kernels replaced by their output allocations
only (Triton does not run on a CPU): what is left is the host work of that path but the
kernels' launches, op for op (attention stays the CPU's masked SDPA, not flash attention's
lower-right form).

    python bench/prefill_host.py [--layers 15] [--prefix 1000] [--rows 5] [--gpu-path] [--profile]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor, Segment  # noqa: E402
from layersplit.shards.tiny import write_tiny_checkpoint  # noqa: E402

log = logging.getLogger("prefill_host")
BLOCK = 16


def build(layers: int, max_len: int, last: bool) -> RangeExecutor:
    """A range of `layers` layers of a 2 * layers-layer tiny Llama (hidden 64) over a paged
    cache whose slot 0 covers `max_len` rows; the last range if `last`, else the first."""
    folder = Path(tempfile.mkdtemp(prefix="prefill_host_"))
    write_tiny_checkpoint(folder, "llama", num_layers=2 * layers, max_position_embeddings=max_len)
    ckpt = open_checkpoint(folder)
    a, b = (layers, 2 * layers) if last else (0, layers)
    blocks = -(-max_len // BLOCK)
    ex = RangeExecutor(load_layer_range(ckpt, a, b), max_len, 1, "cpu", paged=(blocks, BLOCK))
    ex.kv.set_table(0, 0, list(range(blocks)))
    return ex


def stub_row_kernels() -> None:
    """The row kernels (`shards.kernels.row_ops`) as the allocations of their outputs only."""
    from layersplit.shards.kernels import row_ops

    def add_rms_norm(h, x, w, eps):
        return torch.empty_like(h), None if w is None else torch.empty_like(h)

    def rope_qk(qkv, cos, sin, nh, ng, qn_w=None, kn_w=None, eps=0.0):
        n, d = qkv.shape[0], qkv.shape[1] // (nh + 2 * ng)
        return (torch.empty(n, nh, d, dtype=qkv.dtype), torch.empty(n, ng, d, dtype=qkv.dtype))

    row_ops.add_rms_norm = add_rms_norm
    row_ops.rms_norm_rows = lambda h, w, eps: torch.empty_like(h)
    row_ops.silu_mul = lambda gu: torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)
    row_ops.rope_qk = rope_qk


def step_input(ex: RangeExecutor, rows: int) -> torch.Tensor:
    if ex.model.is_first:
        return torch.arange(rows) % ex.model.cfg.vocab_size
    return torch.randn(rows, ex.model.cfg.hidden_size)


def time_steps(ex: RangeExecutor, pos: int, rows: int, repeat: int) -> list[float]:
    """Wall seconds of `repeat` steps of `rows` rows at `pos` (each rewrites the same rows)."""
    x = step_input(ex, rows)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ex.run_segments(x, [Segment(0, pos, rows)])
        out.append(time.perf_counter() - t0)
    return out


def profile_step(ex: RangeExecutor, pos: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    x = step_input(ex, rows)
    ex.run_segments(x, [Segment(0, pos, rows)])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        ex.run_segments(x, [Segment(0, pos, rows)])
    layers = ex.model.num_layers
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    events.sort(key=lambda e: -e.count)
    total = sum(e.count for e in events)
    print(f"aten ops of one step: {total} ({total / layers:.1f} a layer)")
    for e in events[:40]:
        print(f"  {e.key:40s} {e.count:5d} ({e.count / layers:5.1f}/layer) "
              f"self cpu {e.self_cpu_time_total:8.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--prefix", type=int, default=1000, help="cached tokens before the step")
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--last", action="store_true", help="the last range (with the LM head)")
    p.add_argument("--gpu-path", action="store_true",
                   help="the GPU shard's layer path, its Triton kernels stubbed (see above)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    ex = build(args.layers, args.prefix + args.rows + 64, args.last)
    if args.gpu_path:
        from layersplit.shards.fused import fuse_projections

        stub_row_kernels()
        fuse_projections(ex.model, compile=False, kernels=True)
    x = step_input(ex, args.prefix)
    ex.run_segments(x, [Segment(0, 0, args.prefix)])  # the cached prefix
    times = time_steps(ex, args.prefix, args.rows, args.repeat)
    med = statistics.median(times[3:])
    print(f"{args.layers} layers, {args.rows} rows after {args.prefix}: median "
          f"{med * 1e3:.3f} ms a step, {med / args.layers * 1e6:.0f} us a layer "
          f"(of {len(times) - 3} steps)")
    if args.profile:
        profile_step(ex, args.prefix, args.rows)


if __name__ == "__main__":
    main()
