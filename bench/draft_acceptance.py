"""A DFlash draft's acceptance on the evaluation prompts, measured as `launch/draft_train.py`
measures it (tokens per verify step, walking greedy answers as the runtime does), on three sets of
the target's answers to the same 12 prompts (`draft.prompts.EVAL_*`):

- `--outputs FILE`: the answers a run of `bench/speculative.py` decoded (its `--json`; the plain
  row's outputs), e.g. on GPUs in bf16;
- `--hf`: transformers' greedy answers, here, in `--dtype`;
- `--runtime N`: the answers of the split runtime, here (2 CPU shards, float32), speculating
  with the draft, for the first N prompts: its own acceptance next to the measure on them.

The same draft scores differently on the three sets when the answers differ (they part after a
few dozen tokens between numeric paths); where the answers are the same, the measure and the
runtime agree.

    python bench/draft_acceptance.py --draft default --outputs spec.json --hf --runtime 3
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.draft.dflash import load_dflash  # noqa: E402
from layersplit.draft.dflash_config import read_dflash_config  # noqa: E402
from layersplit.draft.measure import acceptance, greedy_labels, target_rows  # noqa: E402
from layersplit.draft.prompts import EVAL_CHAT, EVAL_CODE  # noqa: E402
from layersplit.launch.draft_train import continuations  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.runtime.model_store import BUNDLED_DRAFT, resolve_model  # noqa: E402
from layersplit.runtime.tokenizer import TextTokenizer  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="default", help="a DFlash folder, or 'default' (bundled)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--outputs", default=None, help="bench/speculative.py --json output")
    p.add_argument("--hf", action="store_true", help="also transformers' greedy answers")
    p.add_argument("--runtime", type=int, default=0, help="also the runtime's, first N prompts")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--runtime-tokens", type=int, default=128)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = BUNDLED_DRAFT if args.draft == "default" else Path(args.draft)
    model_path = resolve_model(args.model)
    tok = TextTokenizer.for_model(model_path)
    ckpt = open_checkpoint(model_path)
    dtype = getattr(torch, args.dtype)
    target = load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, args.device)
    cfg = read_dflash_config(folder)
    draft = load_dflash(folder, cfg, torch.float32, args.device)
    head = target.lm_head.weight.float()
    embed = target.embed_tokens.weight.float()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in EVAL_CHAT + EVAL_CODE]

    def measure(answers: list[list[int]], which: list[int]) -> float:
        seqs = [prompts[i] + a for i, a in zip(which, answers)]
        rows = target_rows(target, seqs, [len(prompts[i]) for i in which],
                           list(cfg.target_layer_ids), args.device)
        rows.feats, rows.final = rows.feats.float(), rows.final.float()
        return acceptance(draft, head, embed, rows, greedy_labels(rows.final, head),
                          cfg.block_size, cfg.mask_token_id)

    everything = list(range(len(prompts)))
    if args.outputs:
        plain = json.loads(Path(args.outputs).read_text())[0]["outputs"]
        answers = [plain[str(i)] for i in everything]
        print(f"on {args.outputs}'s answers: {measure(answers, everything):.2f} tokens per verify")
    if args.hf:
        seqs = continuations(target, prompts, args.new_tokens, 0.0, len(prompts), args.device,
                             ckpt.config.eos_token_ids[0], tuple(tok.eos_ids))
        answers = [s[len(q):] for s, q in zip(seqs, prompts)]
        print(f"on transformers' {args.dtype} answers: {measure(answers, everything):.2f}")
    if args.runtime:
        rc = RuntimeConfig(model=args.model, devices=("cpu", "cpu"), draft=str(folder),
                           max_context=1024, threads=1, prefix_cache=False)
        params = SamplingParams(max_tokens=args.runtime_tokens)
        with Coordinator(rc) as coord:
            for i in range(args.runtime):
                progress = Progress()
                r = collect(coord.stream(prompts[i], params, progress), progress,
                            len(prompts[i]))
                got = progress.spec.acceptance_length if progress.spec else None
                # the measure walks only anchors with a whole block after them
                m = (f"{measure([r.tokens], [i]):.2f}" if len(r.tokens) > cfg.block_size
                     else "- (no whole block)")
                print(f"prompt {i}: runtime {got:.2f}, measure {m} ({len(r.tokens)} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
