"""Where a bfloat16 run departs from float32: ours against transformers' own, on one device.

    python3 bench/bf16_layers.py --family llama --limit 24 --new-tokens 64 [--narrow]

A family's reduced shape (`shards.shape_checkpoints`; `--narrow`: hidden 1024, the published
head dim, for a CPU) is run by transformers in float32 (the reference: greedy tokens and logits,
as `layersplit check`), then, on the reference's tokens, by

- transformers bfloat16, the whole sequence in one forward (`half_agreement`'s way);
- transformers bfloat16, the prompt then one token a step with its cache (our way of feeding
  it: a control for the split of the work alone);
- ours bfloat16 (`RangeExecutor`, the runtime's arithmetic): the prompt's prefill then one
  decode step a token, as `runtime.check.teacher_forced`.

Each is compared with the reference position by position (top-1, KL), and ours with
transformers' paired: the positions where only one of the two misses the reference's top-1, and
a bootstrap over prompts of the differences, so a gap can be told from the noise of a few
hundred positions. Each layer's output rows at those positions are compared with float32's too
(mean relative error ||h - h32|| / ||h32||): where ours departs more, it shows from that layer on.
On a GPU, ours is the runtime's GPU path (fused projections, the Triton kernels, CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layersplit.runtime.check import encode_prompts, load_prompts  # noqa: E402
from layersplit.runtime.check_reference import load_transformers, run_reference  # noqa: E402
from layersplit.runtime.parity import kl_divergence  # noqa: E402
from layersplit.runtime.tokenizer import TextTokenizer  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from layersplit.shards.shape_checkpoints import write_shape_checkpoint  # noqa: E402

log = logging.getLogger("bf16_layers")

# CPU widths: the published head dim and GQA ratio, a quarter of the 8B widths
NARROW = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128)


# (logits (positions, vocab) float32, each layer's output rows [(positions, hidden)]) of the
# reference's continuation: row i is what its token i was drawn from
Rows = tuple[np.ndarray, list[torch.Tensor]]


def hf_full(hf, prompt: list[int], tokens: list[int], device: str) -> Rows:
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
    a = len(prompt) - 1
    return (out.logits[0, a:].float().cpu().numpy(),
            [h[0, a:].float().cpu() for h in out.hidden_states[1:]])


def hf_steps(hf, prompt: list[int], tokens: list[int], device: str) -> Rows:
    rows, layers, past = [], [], None
    with torch.no_grad():
        for ids in [prompt] + [[t] for t in tokens[:-1]]:
            out = hf(input_ids=torch.tensor([ids], device=device), past_key_values=past,
                     use_cache=True, output_hidden_states=True)
            past = out.past_key_values
            rows.append(out.logits[0, -1].float().cpu().numpy())
            layers.append([h[0, -1].float().cpu() for h in out.hidden_states[1:]])
    return np.stack(rows), [torch.stack(x) for x in zip(*layers)]


def ours_steps(ex: RangeExecutor, prompt: list[int], tokens: list[int]) -> Rows:
    """The prompt's prefill, then one decode step a token (`runtime.check.teacher_forced`)."""
    rows, layers, pos = [], [], 0
    for ids in [prompt] + [[t] for t in tokens[:-1]]:
        taps: dict[int, torch.Tensor] = {}
        out = ex.run(torch.tensor(ids, device=ex.device), pos, taps=taps)
        rows.append(out.float().cpu().numpy()[-1])
        layers.append([taps[i][-1].float().cpu() for i in sorted(taps)])
        pos += len(ids)
    return np.stack(rows), [torch.stack(x) for x in zip(*layers)]


def layer_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> np.ndarray:
    """(layers, positions): ||h - h_ref|| / ||h_ref|| of each layer's output row."""
    return np.stack([((g.double() - r.double()).norm(dim=-1) / r.double().norm(dim=-1)).numpy()
                     for r, g in zip(ref, got)])


def per_position(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, ...]:
    """(top-1 equal, KL(ref ‖ got), the reference's top-1 logit minus its second, the RMS of
    the logits' error less its mean) of each position: a miss where the margin is far above
    the error's RMS would be no near-tie."""
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    err = got.astype(np.float64) - ref
    rms = np.sqrt(((err - err.mean(-1, keepdims=True)) ** 2).mean(-1))
    return (ref.argmax(-1) == got.argmax(-1), kl_divergence(ref, got), top2[:, 1] - top2[:, 0],
            rms)


def bootstrap(a: list[np.ndarray], b: list[np.ndarray], n: int = 2000, seed: int = 0
              ) -> tuple[float, float, float]:
    """The mean over positions of a - b, and its 95 % interval, resampling whole prompts."""
    rng = np.random.default_rng(seed)
    diffs = [x.astype(np.float64) - y.astype(np.float64) for x, y in zip(a, b)]
    sums = np.array([d.sum() for d in diffs])
    lens = np.array([len(d) for d in diffs])
    est = sums.sum() / lens.sum()
    picks = rng.integers(0, len(diffs), size=(n, len(diffs)))
    boots = sums[picks].sum(1) / lens[picks].sum(1)
    return float(est), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default=os.environ.get("LAYERSPLIT_SHAPES", "/tmp/shapes"),
                   help="where the shape folders are (made there once: parity.py's too)")
    p.add_argument("--narrow", action="store_true", help="CPU widths (NARROW)")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (CPU)")
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    over = dict(NARROW) if args.narrow else {}
    if args.vocab:
        over["vocab_size"] = args.vocab
    name = args.family + ("-narrow" if args.narrow else "") + \
        (f"-v{args.vocab}" if args.vocab else "")
    path = write_shape_checkpoint(Path(args.dir) / name, args.family, args.device, **over)
    tok = TextTokenizer.for_model(path)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    stop = tuple(tok.eos_ids if tok is not None else ()) or tuple(cfg.eos_token_ids)
    prompts = encode_prompts(load_prompts(None)[:args.limit], tok, cfg.vocab_size)
    t0 = time.perf_counter()
    refs = run_reference("transformers", path, prompts, args.new_tokens, stop, args.device)
    log.info("float32 reference: %.1f s", time.perf_counter() - t0)
    hf32 = load_transformers(path, args.device, "float32")
    hf16 = load_transformers(path, args.device, "bfloat16")
    part = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16, args.device)
    if args.device.startswith("cuda"):  # the runtime's GPU path: kernels, CUDA graphs
        fuse_projections(part)
    longest = max(len(p) for p in prompts) + args.new_tokens + 1
    ex = RangeExecutor(part, max_len=longest, device=args.device,
                       taps=tuple(range(cfg.num_layers)))
    names = ("transformers bf16 (one forward)", "transformers bf16 (steps)", "ours bf16 (steps)")
    runs: dict[str, list] = {k: [] for k in names}
    errors: dict[str, list] = {k: [] for k in names}
    for i, ref in enumerate(refs):
        _, ref_layers = hf_full(hf32, ref.prompt, ref.tokens, args.device)
        got = dict(zip(names, (hf_full(hf16, ref.prompt, ref.tokens, args.device),
                               hf_steps(hf16, ref.prompt, ref.tokens, args.device),
                               ours_steps(ex, ref.prompt, ref.tokens))))
        for k, (logits, layers) in got.items():
            runs[k].append(per_position(ref.logits, logits))
            errors[k].append(layer_error(ref_layers, layers))
        log.info("prompt %d/%d", i + 1, len(refs))
    report: dict = {"family": args.family, "path": str(path), "device": args.device,
                    "prompts": len(refs),
                    "positions": int(sum(len(r.tokens) for r in refs)), "runs": {}}
    for k, rows in runs.items():
        top1 = np.concatenate([r[0] for r in rows])
        kl = np.concatenate([r[1] for r in rows])
        err = np.concatenate(errors[k], axis=1).mean(axis=1)
        margin = np.concatenate([r[2] for r in rows])[~top1]
        rms = np.concatenate([r[3] for r in rows]).mean()
        report["runs"][k] = {"top1": round(float(top1.mean()), 5),
                             "mean_kl": float(f"{kl.mean():.4g}"),
                             "logit_error_rms": float(f"{rms:.3g}"),
                             "misses": int((~top1).sum()),
                             # (a greedy loop repeats a near-tie: misses come in clumps)
                             "misses by prompt": [int((~r[0]).sum()) for r in rows],
                             "widest missed margin": float(f"{margin.max():.3g}")
                             if len(margin) else 0.0,
                             "layer_rel_error": [float(f"{e:.4g}") for e in err]}
    pairs = ((names[2], names[0]), (names[1], names[0]), (names[2], names[1]))
    for other, base in pairs:  # (the second: the noise of the split of the work alone)
        a, b = runs[other], runs[base]
        report[f"{other} - {base}"] = {
            "misses only here": int(sum(((~x[0]) & y[0]).sum() for x, y in zip(a, b))),
            "misses only there": int(sum((x[0] & ~y[0]).sum() for x, y in zip(a, b))),
            "top1 diff (95% CI)": [round(v, 5) for v in
                                   bootstrap([x[0] for x in a], [y[0] for y in b])],
            "kl diff (95% CI)": [float(f"{v:.3g}") for v in
                                 bootstrap([x[1] for x in a], [y[1] for y in b])]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
