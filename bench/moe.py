"""Decode speed of a mixture-of-experts model (Qwen3-30B-A3B shape, or a DeepSeek-V3-style MLA
shape; seeded random weights) through the real runtime: 1 shard vs 2 shards on the same device.

For each layout: decode tok/s at batch 1 (the median of `--repeats` runs, each listed, after a
warm-up that captures the graphs), next to its floor on a GPU: the bytes of the parameters one token
reads (attention, router, norms, its k experts of each MoE layer, the LM head, one embedding row)
over the copy bandwidth measured now; then aggregate decode tok/s with `--streams` concurrent
sequences (continuous batching; `bench/concurrency.py`'s measurement).

    python bench/moe.py --device cuda:0 --streams 8,32            # Qwen3-30B-A3B shape
    python bench/moe.py --shape tiny --device cpu --new-tokens 16   # any machine, seconds
    python bench/moe.py --layouts cuda:0 cuda:0,cuda:1 --streams 8  # 1 GPU vs 2 GPUs
    python bench/moe.py --shape deepseek-v2-lite --streams 8        # latent attention (MLA)

The 30B-A3B shape is configs/models/qwen3-30b-a3b: 48 layers, hidden 2048, 32 query / 4 KV
heads of 128, 128 experts of width 768, 8 per token, vocab 151936 (Qwen3-30B-A3B's published
config.json). The DeepSeek-V2-Lite-width shape is configs/models/deepseek-v2-lite-shape (27
layers, hidden 2048, 16 MLA heads, a 512 + 64 latent, 64 experts of width 1408, 6 per token and 2
shared, DeepSeek-V3's grouped routing). Prints a table last; `--json FILE` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.shards.model_config import ModelConfig, config_from_hf  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402
from layersplit.shards.tiny import FAMILY_CONFIGS  # noqa: E402
from layersplit.shards.weights import range_tensor_shapes  # noqa: E402

from bench.concurrency import run_streams  # noqa: E402
from bench.decode import prompt_ids  # noqa: E402

log = logging.getLogger("bench.moe")
# --shape -> (configs/models preset, its name in the table)
SHAPES = {"30b-a3b": ("qwen3-30b-a3b", "Qwen3-MoE 30b-a3b"),
          "deepseek-v2-lite": ("deepseek-v2-lite-shape", "DeepSeek-V2-Lite-width MLA")}


def tiny_shape(folder: Path) -> str:
    """A 6-layer tiny Qwen3-MoE config (the tests' shape) as a `random:` model."""
    raw = {**FAMILY_CONFIGS["qwen3_moe"], "num_hidden_layers": 6, "vocab_size": 320,
           "max_position_embeddings": 4096, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(raw))
    return f"random:{folder}"


def active_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of parameters one decoded token reads: every tensor but the embedding (one row)
    and the experts (k of E)."""
    total = 0
    for name, shape in range_tensor_shapes(cfg, 0, cfg.num_layers).items():
        n = 1
        for s in shape:
            n *= s
        if name == "model.embed_tokens.weight":
            n = cfg.hidden_size
        elif ".mlp.experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        total += n * itemsize
    return total


def copy_bandwidth(device: str) -> float:
    """Bytes per second read + written by a 1 GiB device-to-device copy, measured now."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 20 / (start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return bw


def run_layout(args, devices: list[str]) -> dict:
    counts = [int(s) for s in args.streams.split(",") if s]
    cfg = RuntimeConfig(model=args.model, devices=tuple(devices), dtype=args.dtype,
                        max_context=args.prompt_len + args.new_tokens + 8,
                        prefill_chunk=args.prefill_chunk, max_seqs=max(counts + [1]),
                        draft="none", prefix_cache=False, threads=args.threads,
                        decode_ahead=args.decode_ahead == "on")
    row: dict = {"layout": ",".join(devices), "shards": len(devices)}
    with Coordinator(cfg) as coord:
        prompt = prompt_ids(args.prompt_len, coord.model_config.vocab_size)
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        rates = []
        for i in range(args.repeats + 1):  # the first run captures graphs
            progress = Progress()
            r = collect(coord.stream(prompt, params, progress, use_cache=False), progress,
                        len(prompt))
            assert len(r.tokens) == args.new_tokens, len(r.tokens)
            if i:
                rates.append(r.decode_tok_s)
        row["decode_tok_s"] = statistics.median(rates)
        row["runs"] = rates
        log.info("%s: batch 1 %.1f tok/s", row["layout"], row["decode_tok_s"])
        row["streams"] = {}
        for n in counts:
            run_streams(coord, n, args)  # warm-up: captures this batch size's graphs
            s = run_streams(coord, n, args)
            log.info("%s, %d streams: %.1f tok/s", row["layout"], n, s["decode_tok_s"])
            row["streams"][n] = s["decode_tok_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "tiny"], default="30b-a3b")
    ap.add_argument("--device", default="cuda:0", help="both layouts run on this device")
    ap.add_argument("--layouts", nargs="+", default=None,
                    help="comma-separated device lists instead (e.g. cuda:0 cuda:0,cuda:1); "
                         "the first is the baseline")
    ap.add_argument("--streams", default="8,32", help="concurrent streams, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-ahead", default="on", choices=["on", "off"],
                    help="decode lookahead (one shard; `decode_ahead`)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        args.model = (f"random:{SHAPES[args.shape][0]}" if args.shape in SHAPES
                      else tiny_shape(Path(tmp)))
        spec = args.model.removeprefix("random:")
        folder = Path(spec) if "/" in spec else Path(__file__).resolve().parents[1] / \
            "configs" / "models" / spec
        mcfg = config_from_hf(json.loads((folder / "config.json").read_text()), folder)
        layouts = ([lay.split(",") for lay in args.layouts] if args.layouts
                   else [[args.device] * n for n in (1, 2)])
        rows = [run_layout(args, devices) for devices in layouts]
    device = layouts[0][0]  # the baseline's device: the floor's bandwidth is measured on it
    on_gpu = device.startswith("cuda")
    itemsize = 2 if on_gpu and args.dtype in ("auto", "bfloat16", "float16") else 4
    per_token = active_bytes_per_token(mcfg, itemsize)
    floor = None
    if on_gpu:
        bw = copy_bandwidth(device)
        floor = {"copy_GBps": bw / 1e9, "active_bytes_per_token": per_token,
                 "floor_tok_s": bw / per_token}
    name = torch.cuda.get_device_name(0) if on_gpu else os.uname().machine
    out = {"shape": args.shape, "model": args.model if args.shape in SHAPES else "tiny",
           "device": name, "rows": rows, "floor": floor}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    base = rows[0]
    title = SHAPES[args.shape][1] if args.shape in SHAPES else "tiny Qwen3-MoE"
    print(f"\n{title} shape on {name}; prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens; active parameters "
          f"{per_token / itemsize / 1e6:.1f} M ({per_token / 1e6:.1f} MB) per token")
    counts = list(base["streams"])
    print("| layout | batch 1 tok/s | vs 1 shard | vs floor | "
          + " | ".join(f"{n} streams tok/s" for n in counts) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(counts))
    for r in rows:
        vs_floor = f"{r['decode_tok_s'] / floor['floor_tok_s']:.0%}" if floor else "-"
        runs = "/".join(f"{x:.1f}" for x in r["runs"])
        print(f"| {r['shards']} shard(s) on {r['layout']} | {r['decode_tok_s']:.1f} ({runs}) | "
              f"{r['decode_tok_s'] / base['decode_tok_s']:.3f} | {vs_floor} | "
              + " | ".join(f"{r['streams'][n]:.1f}" for n in counts) + " |")
    if floor:
        print(f"floor: {floor['copy_GBps']:.0f} GB/s copy (read + write) / "
              f"{per_token / 1e9:.2f} GB per token = {floor['floor_tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
