"""Host cost of one eager prefill step of a shard's layer range: the wall time of a few-row step
after a cached prefix, on a model whose arithmetic is negligible (the default: a tiny Llama of
hidden 64), is the host's (Python, torch dispatch, kernel launches). Prints the median step
time and the time per layer; `--profile` adds the aten ops of one step grouped by name (counts
per layer); `--calls` the host time of each call one layer's eager step makes, one by one.

On a CPU the layers run the CPU's torch path unless `--gpu-path`: then they run as a GPU
shard's do (`FusedDecode.prefill`: fused projections, the row kernels around attention), the
Triton row kernels replaced by their output allocations only (Triton does not run on a CPU),
so that path's host work shows op for op but the kernels' launches (attention stays the CPU's
masked SDPA, not flash attention's lower-right form). On a GPU (`--device cuda:0`) the range
runs exactly as a shard's: fused, real kernels.

    python bench/prefill_host.py [--layers 15] [--prefix 1000] [--rows 5] [--gpu-path]
    python bench/prefill_host.py --device cuda:0 --dtype float16 \
        --model random:smollm2-135m-shape --calls --profile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor, Segment  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from layersplit.shards.layers.step import StepInfo  # noqa: E402
from layersplit.shards.tiny import write_tiny_checkpoint  # noqa: E402

BLOCK = 16
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build(model: str | None, layers: int, max_len: int, last: bool, dtype: torch.dtype,
          device: str) -> RangeExecutor:
    """`layers` layers of `model` (None: a tiny Llama of 2 x `layers` layers, hidden 64) over
    a paged cache whose slot 0 covers `max_len` rows: the last range if `last`, else the
    first. On a GPU fused as a shard's (`fuse_projections`)."""
    if model is None:
        folder = Path(tempfile.mkdtemp(prefix="prefill_host_"))
        model = str(write_tiny_checkpoint(folder, "llama", num_layers=2 * layers,
                                          max_position_embeddings=max_len))
    ckpt = open_checkpoint(model)
    total = ckpt.config.num_layers
    a, b = (total - layers, total) if last else (0, layers)
    blocks = -(-max_len // BLOCK)
    rng = load_layer_range(ckpt, a, b, dtype, device)
    if torch.device(device).type == "cuda":
        fuse_projections(rng, compile=False)
    ex = RangeExecutor(rng, max_len, 1, device, paged=(blocks, BLOCK))
    ex.kv.set_table(0, 0, list(range(blocks)))
    return ex


def stub_row_kernels() -> None:
    """The row kernels (`shards.kernels.row_ops`) as the allocations of their outputs only."""
    from layersplit.shards.kernels import row_ops

    def add_rms_norm(h, x, w, eps):
        return torch.empty_like(h), None if w is None else torch.empty_like(h)

    def rope_qk(qkv, cos, sin, nh, ng, qn_w=None, kn_w=None, eps=0.0, pool=None):
        n, d = qkv.shape[0], qkv.shape[1] // (nh + 2 * ng)
        return (torch.empty(n, nh, d, dtype=qkv.dtype), torch.empty(n, ng, d, dtype=qkv.dtype))

    row_ops.add_rms_norm = add_rms_norm
    row_ops.rms_norm_rows = lambda h, w, eps: torch.empty_like(h)
    row_ops.silu_mul = lambda gu: torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)
    row_ops.rope_qk = rope_qk


def step_input(ex: RangeExecutor, rows: int) -> torch.Tensor:
    if ex.model.is_first:
        return torch.arange(rows, device=ex.device) % ex.model.cfg.vocab_size
    return torch.randn(rows, ex.model.cfg.hidden_size, device=ex.device, dtype=ex.dtype)


def sync(ex: RangeExecutor) -> None:
    if ex.device.type == "cuda":
        torch.cuda.synchronize(ex.device)


def time_steps(ex: RangeExecutor, pos: int, rows: int, repeat: int) -> list[float]:
    """Wall seconds of `repeat` steps of `rows` rows at `pos` (each rewrites the same rows),
    each from an idle device: the host's time to queue the step."""
    x = step_input(ex, rows)
    out = []
    for _ in range(repeat):
        sync(ex)
        t0 = time.perf_counter()
        ex.run_segments(x, [Segment(0, pos, rows)])
        out.append(time.perf_counter() - t0)
    sync(ex)
    return out


def profile_step(ex: RangeExecutor, pos: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    x = step_input(ex, rows)
    ex.run_segments(x, [Segment(0, pos, rows)])
    sync(ex)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        ex.run_segments(x, [Segment(0, pos, rows)])
        sync(ex)
    layers = ex.model.num_layers
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    events.sort(key=lambda e: -e.count)
    total = sum(e.count for e in events)
    print(f"aten ops of one step: {total} ({total / layers:.1f} a layer)")
    for e in events[:40]:
        print(f"  {e.key:48s} {e.count:5d} ({e.count / layers:5.1f}/layer) "
              f"self cpu {e.self_cpu_time_total:8.0f} us")


def host_us(ex: RangeExecutor, fn: Callable[[], object], n: int = 300) -> float:
    """Median host µs of `fn()` over batches of calls (the device not waited on)."""
    fn()
    sync(ex)
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        batches.append((time.perf_counter() - t0) / (n // 5) * 1e6)
        sync(ex)
    return statistics.median(batches)


def layer_calls(ex: RangeExecutor, pos: int, rows: int, cprofile: bool = False) -> None:
    """Host µs of each call one layer's eager step makes on its fast path (`FusedDecode.
    prefill`), called one by one with that step's operands, next to the whole layer's."""
    from layersplit.shards import fused
    from layersplit.shards.kernels import row_ops
    from layersplit.shards.layers.attention import attend

    model, kv = ex.model, ex.kv
    idx = 1 if model.num_layers > 1 else 0  # (the first layer also norms its input)
    layer = model.layers[idx]
    fast = layer.fast
    if fast is None:
        print("--calls: the layers have no fused step (a GPU's, or --gpu-path)")
        return
    a, m = layer.self_attn, layer.mlp
    dev, dt, hidden = ex.device, ex.dtype, model.cfg.hidden_size
    h = torch.randn(rows, hidden, device=dev, dtype=dt)
    nh, ng, d = a.num_heads, a.num_kv_heads, a.head_dim
    ln, ln2 = layer.input_layernorm, layer.post_attention_layernorm

    def new_step() -> StepInfo:
        return StepInfo.eager(pos, rows, dev)

    step = new_step()
    cos, sin = (t.to(dt) for t in (torch.ones(rows, d, device=dev),) * 2)
    qkv = fused.linear(a.qkv_proj, h)
    q, k = row_ops.rope_qk(qkv, cos, sin, nh, ng)
    v = qkv[:, (nh + ng) * d:].view(-1, ng, d)
    keys, values = kv.append(idx, 0, step, k, v)
    attn = attend(q, keys, values, step.mask, True, a.sdpa_scale)
    gu = fused.linear(m.gate_up_proj, h)
    act = row_ops.silu_mul(gu)
    calls = {
        "StepInfo.eager (once a step)": new_step,
        "qkv projection": lambda: fused.linear(a.qkv_proj, h),
        "row_ops.rope_qk": lambda: row_ops.rope_qk(qkv, cos, sin, nh, ng),
        "kv.append (write + gather)": lambda: kv.append(idx, 0, step, k, v),
        "attend": lambda: attend(q, keys, values, step.mask, True, a.sdpa_scale),
        "o_proj": lambda: fused.linear(a.o_proj, attn),
        "row_ops.add_rms_norm": lambda: row_ops.add_rms_norm(h, h, ln2.weight, ln2.eps),
        "gate/up projection": lambda: fused.linear(m.gate_up_proj, h),
        "row_ops.silu_mul": lambda: row_ops.silu_mul(gu),
        "down projection": lambda: fused.linear(m.down_proj, act),
        "whole layer (fast.prefill)": lambda: fast.prefill(layer, h, cos, sin, kv, idx, 0, step),
    }
    print(f"host us per call, one layer's eager step of {rows} rows after {pos} (norm weight "
          f"{tuple(ln.weight.shape)}):")
    for name, fn in calls.items():
        print(f"  {name:32s} {host_us(ex, fn):8.1f}")
    if cprofile:
        from bench.host_costs import profile_calls

        print("where the whole layer's host time goes (cProfile, own time, top 30):")
        profile_calls(calls["whole layer (fast.prefill)"], n=300, top=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: a tiny Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--prefix", type=int, default=1000, help="cached tokens before the step")
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--last", action="store_true", help="the last range (with the LM head)")
    p.add_argument("--gpu-path", action="store_true",
                   help="on a CPU, the GPU shard's layer path, its Triton kernels stubbed")
    p.add_argument("--profile", action="store_true", help="aten ops of one step, by name")
    p.add_argument("--calls", action="store_true", help="host time of each call of a layer")
    p.add_argument("--cprofile", action="store_true",
                   help="with --calls: the whole layer's host time by function (cProfile)")
    args = p.parse_args()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    ex = build(args.model, args.layers, args.prefix + args.rows + 64, args.last,
               DTYPES[args.dtype], args.device)
    if args.gpu_path and ex.device.type == "cpu":
        stub_row_kernels()
        fuse_projections(ex.model, compile=False, kernels=True)
    x = step_input(ex, args.prefix)
    ex.run_segments(x, [Segment(0, 0, args.prefix)])  # the cached prefix
    times = time_steps(ex, args.prefix, args.rows, args.repeat)
    med = statistics.median(times[3:])
    fast = getattr(ex.model.layers[0], "fast", None)
    if fast is not None and not fast.prefill_kernels:
        print("the row kernels failed: the layers ran the torch path (see the log)")
    print(f"{args.layers} layers on {args.device}, {args.rows} rows after {args.prefix}: median "
          f"{med * 1e3:.3f} ms a step, {med / args.layers * 1e6:.0f} us a layer "
          f"(of {len(times) - 3} steps)")
    if args.profile:
        profile_step(ex, args.prefix, args.rows)
    if args.calls:
        layer_calls(ex, args.prefix, args.rows, args.cprofile)
    if args.cprofile:
        from bench.host_costs import profile_calls

        x = step_input(ex, args.rows)
        print("where a whole step's host time goes (cProfile, own time, top 40):")
        profile_calls(lambda: ex.run_segments(x, [Segment(0, args.prefix, args.rows)]), n=40,
                      top=40)


if __name__ == "__main__":
    main()
