"""One layer's attention stage of a decode step: the compiled torch path against the Triton
decode-attention kernel (`shards.kernels.decode_attention`), each captured in a CUDA graph.

    python bench/attention_kernel.py [--keys 256,768,2048,8192] [--splits auto,0,128,256]

Torch path: the compiled norm + q/k/v projection + q/k norm + rotary (`shards.fused.pre_attention`),
`KVCache.append` (two index_copy_) and `Attention._grouped`. Kernel path: the compiled norm +
projection (`shards.fused.norm_qkv`), then the kernel, once per key-split setting (keys per
program; 0: never split; auto: `key_split`). Times are medians of graph replays of 100 layers
(distinct KV caches, so the keys come from HBM, not L2), per layer; also max |difference|.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.fused import norm_qkv, pre_attention  # noqa: E402
from layersplit.shards.kernels.decode_attention import decode_attention  # noqa: E402
from layersplit.shards.layers.step import StepInfo  # noqa: E402

SHAPES = {  # name: hidden, heads, kv heads, head dim, q/k norm
    "smollm2-135m": (576, 9, 3, 64, False),
    "qwen3-8b": (4096, 32, 8, 128, True),
}
LAYERS = 100


def grouped(q, keys, values, mask, g, d):
    """`Attention._grouped` (same code, without the module)."""
    r = q.shape[1]
    scores = torch.matmul(q, keys.permute(1, 2, 0)) * (d ** -0.5)
    scores = scores.masked_fill(~mask.repeat(r, 1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.transpose(0, 1))
    return out.view(g, r, 1, d).permute(2, 0, 1, 3).reshape(1, -1)


def time_graph(fn, reps: int = 20) -> float:
    """Median ms of one replay of a graph of `fn` over every layer."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="256,768,2048,8192")
    ap.add_argument("--splits", default="auto,0,128,256")
    args = ap.parse_args()
    dev, dt = "cuda:0", torch.bfloat16
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    heads = [f"split {'auto' if s is None else s}" for s in splits]
    print(f"{'shape':<14} {'keys':>6} {'torch us':>9} " + " ".join(f"{c:>11}" for c in heads) +
          "  max|diff|")
    for name, (hidden, h, g, d, qk_norm) in SHAPES.items():
        for t in [int(k) for k in args.keys.split(",")]:
            torch.manual_seed(0)
            layers = LAYERS if t * g * d * 4 * LAYERS < 8e9 else 8
            kc = torch.randn(layers, 1, t + 1, g, d, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            x = torch.randn(1, hidden, device=dev, dtype=dt)
            ln = torch.ones(hidden, device=dev, dtype=dt)
            w = torch.randn((h + 2 * g) * d, hidden, device=dev, dtype=dt) * hidden ** -0.5
            qn = kn = torch.ones(d, device=dev, dtype=dt) if qk_norm else None
            pos = torch.tensor([t - 1], device=dev)
            step = StepInfo.static(pos, 1, t)
            ang = (t - 1) * (1 / 1e4 ** (torch.arange(0, d, 2, device=dev).float() / d))
            emb = torch.cat([ang, ang])[None]
            cos, sin = emb.cos().to(dt), emb.sin().to(dt)
            pre = torch.compile(pre_attention, fullgraph=True, dynamic=False)
            nq = torch.compile(norm_qkv, fullgraph=True, dynamic=False)
            outs = {}

            def torch_path(outs=outs, kc=kc, vc=vc, layers=layers, h=h, g=g, d=d, t=t, step=step,
                           pre=pre, qn=qn, kn=kn, cos=cos, sin=sin, x=x, ln=ln, w=w):
                for i in range(layers):
                    q, k, v = pre(x, ln, w, None, qn, kn, cos, sin, 1e-6, h, g, d, True)
                    kc[i, 0].index_copy_(0, step.positions, k)
                    vc[i, 0].index_copy_(0, step.positions, v)
                    outs["torch"] = grouped(q, kc[i, 0, :t], vc[i, 0, :t], step.mask, g, d)

            def kernel_path(split, outs=outs, kc=kc, vc=vc, layers=layers, h=h, step=step,
                            nq=nq, qn=qn, kn=kn, cos=cos, sin=sin, x=x, ln=ln, w=w):
                def run():
                    for i in range(layers):
                        qkv = nq(x, ln, w, None, 1e-6)
                        outs[split] = decode_attention(qkv, cos, sin, kc[i], vc[i],
                                                       step.positions, 0, step.mask, 1, h, qn,
                                                       kn, 1e-6, split)
                return run

            with torch.inference_mode():
                base = time_graph(torch_path) / layers * 1e3
                ks = [time_graph(kernel_path(s)) / layers * 1e3 for s in splits]
                diff = max(float((outs[s].float() - outs["torch"].float()).abs().max())
                           for s in splits)
            print(f"{name:<14} {t:>6} {base:>9.2f} " + " ".join(f"{k:>11.2f}" for k in ks) +
                  f"  {diff:.3g}")
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
