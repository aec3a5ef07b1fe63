"""Decode and prefill speed of the split runtime next to its baselines, all in one run.

For one model and several layouts (1 shard, 2 shards, ...): TTFT, prefill tok/s and decode tok/s
at batch 1, through the real runtime (coordinator + shard processes). Baselines from the same
run: HF transformers `generate()` on the very same weights (`--hf`), and the HBM floor, the
bytes of weights read per token divided by the device-to-device copy bandwidth measured now
(`--floor`).

    python bench/decode.py --model random:qwen3-8b --layouts cuda:0 cuda:0,cuda:1 --hf --floor
    python bench/decode.py --model default --layouts cpu cpu,cpu --new-tokens 64
    python bench/decode.py --layouts cpu,cpu cpu,cpu --launcher ray --ray-address HOST:PORT \
        --ray-resources host_a,host_b host_a,host_a      # (one per layout)

The decode column is the median of `--repeats` runs (the figure to report); `best` is the
fastest of them, and `vs first` compares medians with the first layout's. TTFT
is the median of the runs (`ttft_s_runs` in the JSON lists them). `--prefill 8192,32768`
times one-token answers to prompts of those lengths (median of 3 after a warm-up; the runs
listed); on a hybrid model `--hf` is transformers' own model of the same config (prefill only).

Prints a table last; `--json FILE` also writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.runtime.model_store import resolve_model  # noqa: E402
from layersplit.shards.checkpoint import (  # noqa: E402
    RANDOM_PREFIX,
    load_layer_range,
    open_checkpoint,
)
from layersplit.shards.hf_convert import hf_causal_lm  # noqa: E402
from layersplit.shards.random_weights import preset_path  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

log = logging.getLogger("bench.decode")


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 30000), (n,), generator=g).tolist()


def run_layout(args, devices: list[str], prompt: list[int], resources: str = "") -> dict:
    ray = {}
    if args.launcher == "ray":
        ray = {"launcher": "ray", "ray_address": args.ray_address,
               "ray_resources": tuple(resources.split(",")) if resources else ()}
    cfg = RuntimeConfig(model=args.model, devices=tuple(devices), max_context=args.max_context,
                        prefill_chunk=args.prefill_chunk, transport=(args.transport,),
                        cuda_graphs=not args.no_graphs, dtype=args.dtype,
                        threads=args.threads, draft=args.draft, kv_cache_gb=args.kv_cache_gb,
                        capture_at_start=args.capture_at_start == "on",
                        decode_ahead=args.decode_ahead == "on",
                        weight_format=args.weight_format, **ray)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    row: dict = {"layout": ",".join(devices) + (f" on {resources}" if resources else "") + (
                     f" ({args.weight_format})" if args.weight_format != "auto" else ""),
                 "shards": len(devices), "weight_format": args.weight_format}
    with Coordinator(cfg) as coord:
        row["transport"] = ",".join(s["transport_out"] for s in coord.shard_info()[:-1]) or "-"
        runs = []
        for i in range(args.repeats + 1):  # the first run captures graphs / warms caches
            progress = Progress()
            r = collect(coord.stream(prompt, params, progress, use_cache=False), progress,
                        len(prompt))
            assert len(r.tokens) == args.new_tokens, len(r.tokens)
            if i:
                runs.append(r)
            else:  # the first request: what a user gets before anything was replayed
                row.update(first_ttft_s=r.ttft_s, first_decode_tok_s=r.decode_tok_s)
        best = max(runs, key=lambda r: r.decode_tok_s)
        each = sorted(r.decode_tok_s for r in runs)
        ttfts = sorted(r.ttft_s for r in runs)
        row.update(ttft_s=ttfts[len(ttfts) // 2], ttft_s_runs=[r.ttft_s for r in runs],
                   decode_tok_s=best.decode_tok_s,
                   decode_tok_s_runs=[r.decode_tok_s for r in runs],
                   decode_tok_s_median=each[len(each) // 2], tokens=best.tokens[:16])
        for n in args.prefill:
            long_prompt = prompt_ids(n, coord.model_config.vocab_size, seed=n)
            one = SamplingParams(max_tokens=1, ignore_eos=True)
            times = []
            for _ in range(PREFILL_RUNS + 1):  # the first warms (graphs, compiled kernels)
                p = Progress()
                collect(coord.stream(long_prompt, one, p, use_cache=False), p, n)
                times.append(p.ttft_s)
            _prefill_row(row, n, times[1:])
    return row


PREFILL_RUNS = 3


def _prefill_row(row: dict, n: int, times: list[float]) -> None:
    """`prefill_{n}_s`: the median of the runs, which are listed beside it."""
    row[f"prefill_{n}_s"] = sorted(times)[len(times) // 2]
    row[f"prefill_{n}_s_runs"] = times


def _timed(fn, device: str) -> float:
    torch.cuda.synchronize() if device.startswith("cuda") else None
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize() if device.startswith("cuda") else None
    return time.perf_counter() - t0


def hf_model_of_config(model: str, device: str, dtype: torch.dtype):
    """(transformers' own model built from `model`'s config, with its own random init on
    `device`, SDPA attention; its config)."""
    import transformers

    folder = str(resolve_model(model))
    if folder.startswith(RANDOM_PREFIX):  # random:NAME or random:/folder: its config's folder
        name = folder[len(RANDOM_PREFIX):]
        folder = name if Path(name).is_dir() else str(preset_path(name))
    hf_cfg = transformers.AutoConfig.from_pretrained(folder)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                           dtype=dtype).eval()
    return hf, hf_cfg


def hf_hybrid_prefill(args, device: str) -> dict:
    """transformers' own hybrid model (Qwen3.5 / Qwen3-Next, its fla-core kernels where
    installed, SDPA) built from the same config with its own random init on the device (an HF
    copy sharing our tensors would need both in memory at once: 2 x 51 GB at the 27B shape);
    prefill only, one forward of the whole prompt, median of `PREFILL_RUNS` after a warm-up."""
    import transformers

    hf, hf_cfg = hf_model_of_config(args.model, device, getattr(torch, args.hf_dtype))
    row = {"layout": f"HF transformers {transformers.__version__} ({device}), prefill only",
           "shards": 1, "transport": "-", "ttft_s": float("nan"),
           "decode_tok_s": float("nan"), "tokens": []}
    _hf_prefill(args, hf, hf_cfg.vocab_size, row, device)
    del hf
    gc.collect()
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return row


def _hf_prefill(args, hf, vocab: int, row: dict, device: str) -> None:
    """`--prefill` timings of an HF model (one forward of each prompt) into `row`."""
    with torch.inference_mode():
        for n in args.prefill:
            x = torch.tensor([prompt_ids(n, vocab, seed=n)], device=device)
            times = [_timed(lambda: hf(x, logits_to_keep=1), device)
                     for _ in range(PREFILL_RUNS + 1)]
            _prefill_row(row, n, times[1:])


def hf_baseline(args, prompt: list[int], device: str) -> dict:
    """transformers generate() (greedy, its dynamic KV cache, SDPA) on the same weights."""
    import transformers

    ckpt = open_checkpoint(resolve_model(args.model), 0)
    cfg = ckpt.config
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.hf_dtype]
    model = load_layer_range(ckpt, 0, cfg.num_layers, dtype, device)
    hf = hf_causal_lm(model, device, dtype, args.max_context)
    del model
    ids = torch.tensor([prompt], device=device)
    row = {"layout": f"HF transformers {transformers.__version__} ({device})", "shards": 1,
           "transport": "-"}
    with torch.inference_mode():
        def gen(n):
            torch.cuda.synchronize() if device.startswith("cuda") else None
            t0 = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize() if device.startswith("cuda") else None
            return time.perf_counter() - t0, out

        gen(4)
        t1, _ = gen(1)
        tn, out = gen(args.new_tokens)
        row.update(ttft_s=t1, decode_tok_s=(args.new_tokens - 1) / max(tn - t1, 1e-9),
                   tokens=out[0, len(prompt):len(prompt) + 16].tolist())
    _hf_prefill(args, hf, cfg.vocab_size, row, device)
    hf = None  # (its memory back; `gen` holds the name)
    gc.collect()
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return row


def copy_bandwidth(device: str) -> float:
    """Bytes per second read + written by a 1 GiB device-to-device copy, measured now."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 20 / (time.perf_counter() - t0)
    del x, y
    return bw


def hbm_floor(args, device: str) -> dict:
    """Copy bandwidth (read + write) now, and bytes moved per decoded token: the weights, the KV
    rows of the attention layers (read, at the mean context of the decode) and, for a hybrid
    model, its recurrent and conv states (read and written each token)."""
    ckpt = open_checkpoint(resolve_model(args.model), 0)
    cfg = ckpt.config
    from layersplit.shards.quant_plan import kept_bytes, resolve_weight_format
    from layersplit.shards.weights import range_tensor_shapes

    itemsize = torch.empty((), dtype=getattr(torch, args.hf_dtype)).element_size()
    fmt = resolve_weight_format(args.weight_format, ckpt, [device])[0]
    per_token = 0
    for name, shape in range_tensor_shapes(cfg, 0, cfg.num_layers).items():
        n = 1
        for s in shape:
            n *= s
        if name == "model.embed_tokens.weight":
            per_token += cfg.hidden_size * itemsize  # one row is read
        elif fmt == "quantized":  # the blocks kept on the device
            per_token += kept_bytes(ckpt, cfg, {name: shape}, itemsize)
        else:
            per_token += n * itemsize
    context = args.prompt_len + args.new_tokens // 2
    attn_layers, state = cfg.num_layers, 0
    if cfg.hybrid is not None:
        spec = cfg.hybrid
        linear = sum(spec.is_linear(i) for i in range(cfg.num_layers))
        attn_layers -= linear
        state = linear * (spec.num_value_heads * spec.key_head_dim * spec.value_head_dim * 4
                          + spec.conv_dim * (spec.conv_kernel - 1) * itemsize)
    # KV rows read, at the mean context of the decode (a window caps a layer's: not counted)
    kv = cfg.kv_bytes_per_token(attn_layers, itemsize) * context
    extra = {"state_bytes_per_token": 2 * state, "kv_bytes_per_token": kv}
    bw = copy_bandwidth(device)
    torch.cuda.empty_cache()
    total = per_token + sum(extra.values())
    return {"copy_GBps": bw / 1e9, "weight_bytes_per_token": per_token, **extra,
            "bytes_per_token": total, "floor_tok_s": bw / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--layouts", nargs="+", default=["cpu", "cpu,cpu"],
                    help="each: comma-separated devices of one run")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=float, default=0.0,
                    help="each shard's KV pool (default: max_seqs x max-context tokens)")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "dequantize", "quantized"],
                    help="GGUF weights kept in their blocks or dequantized (the floor counts "
                         "the bytes held)")
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--capture-at-start", default="on", choices=["on", "off"],
                    help="capture every step graph while the shards start (the default)")
    ap.add_argument("--decode-ahead", default="on", choices=["on", "off"],
                    help="decode lookahead (one shard; `decode_ahead`)")
    ap.add_argument("--draft", default="none", help="speculative draft (default: none, plain "
                    "decoding)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf", action="store_true", help="HF transformers baseline")
    ap.add_argument("--floor", action="store_true", help="HBM floor (CUDA only)")
    ap.add_argument("--launcher", default="local", choices=["local", "ray"])
    ap.add_argument("--ray-address", default="auto")
    ap.add_argument("--ray-resources", nargs="*", default=[],
                    help="launcher ray: per layout, the shards' node resources (a,b)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ckpt = open_checkpoint(resolve_model(args.model), 0)
    prompt = prompt_ids(args.prompt_len, ckpt.config.vocab_size)
    resources = args.ray_resources or [""] * len(args.layouts)
    rows = [run_layout(args, layout.split(","), prompt, res)
            for layout, res in zip(args.layouts, resources, strict=True)]
    first_dev = args.layouts[0].split(",")[0]
    if args.hf:
        hybrid = ckpt.config.hybrid is not None
        rows.append((hf_hybrid_prefill if hybrid else hf_baseline)(args, *(
            (first_dev,) if hybrid else (prompt, first_dev))))
    floor = hbm_floor(args, first_dev) if args.floor and first_dev.startswith("cuda") else None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else os.uname().machine
    out = {"model": args.model, "device": gpu, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "rows": rows, "floor": floor}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    base = rows[0].get("decode_tok_s_median", rows[0]["decode_tok_s"])
    base_prefill = {c: rows[0].get(c) for c in (f"prefill_{n}_s" for n in args.prefill)}
    print(f"\n{args.model} on {gpu}; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          "batch 1")
    cols = [f"prefill_{n}_s" for n in args.prefill]
    print(f"{'layout':<40} {'transport':<9} {'TTFT ms':>8} {'decode tok/s':>12} "
          f"{'best':>8} {'vs first':>8} " + " ".join(f"{c:>14}" for c in cols))
    for r in rows:
        extra = " ".join(f"{r.get(c, float('nan')) * 1000:>11.0f} ms" for c in cols)
        med = r.get("decode_tok_s_median", r["decode_tok_s"])
        print(f"{r['layout']:<40} {r['transport']:<9} {r['ttft_s'] * 1000:>8.1f} "
              f"{med:>12.1f} {r['decode_tok_s']:>8.1f} {med / base:>8.3f} {extra}")
    if floor:
        parts = f"{floor['weight_bytes_per_token'] / 1e9:.2f} GB of weights"
        if floor["state_bytes_per_token"]:
            parts += f" + {floor['state_bytes_per_token'] / 1e9:.3f} GB of states"
        parts += f" + {floor['kv_bytes_per_token'] / 1e9:.3f} GB of KV"
        print(f"HBM floor: copy {floor['copy_GBps']:.0f} GB/s (read+write), "
              f"{parts} per token -> "
              f"{floor['floor_tok_s']:.0f} tok/s; first layout at "
              f"{base / floor['floor_tok_s']:.1%} of it")
    for c, t0 in base_prefill.items():
        print(f"{c}: " + ", ".join(f"{r['layout']}: {r[c]:.3f} s (runs "
                                   + "/".join(f"{t:.3f}" for t in r[c + '_runs'])
                                   + f"; {r[c] / t0:.2f} x the first layout's time)"
                                   for r in rows if c in r))
    for r in rows:
        if "first_decode_tok_s" in r:
            print(f"{r['layout']}: the first request (before any timed run): TTFT "
                  f"{r['first_ttft_s'] * 1000:.1f} ms, decode {r['first_decode_tok_s']:.1f} tok/s "
                  f"({r['first_decode_tok_s'] / r['decode_tok_s_median']:.2f} x the median)")
    same = [r["tokens"] == rows[0]["tokens"] for r in rows]
    print(f"first 16 greedy tokens equal to the first layout's: {same}")


if __name__ == "__main__":
    main()
