"""How often a DFlash draft's first draft token is kept under sampling, by kind of proposal
(`spec_sampling`), measured offline on the target's sampled answers to both prompt sets of
`bench/speculative.py` (eval, unseen).

At every position of the answers, with p the target's distribution of the next token (after
temperature and top-p) and q the draft's (its first block position, the same filter, cut to its
best 32 tokens as the runtime's draft does), the probability that the first draft token is kept:

- guesses: p(argmax q) (a chain); with its top k as the first level of a tree, the sum of p over
  them;
- coupled: P(argmax p/E = argmax q/E) over the exponential noise E (Monte Carlo, 256 draws of
  E on the union of both supports: exact in expectation);
- rejection: sum min(p, q) (a chain: the most any single sampled draft token can be kept).

Deeper draft positions compound these; the runtime's acceptance lengths are in RESULTS.md.

    python bench/sampled_acceptance.py --temperature 0.7 --top-p 0.9 --new-tokens 64
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.draft.dflash import load_dflash  # noqa: E402
from layersplit.draft.dflash_config import read_dflash_config  # noqa: E402
from layersplit.draft.measure import block_logits, target_rows  # noqa: E402
from layersplit.launch.draft_train import continuations  # noqa: E402
from layersplit.runtime.model_store import BUNDLED_DRAFT, resolve_model  # noqa: E402
from layersplit.runtime.tokenizer import TextTokenizer  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.sampling import filtered_probs  # noqa: E402
from layersplit.shards.spec_sampling import proposal_q  # noqa: E402

from bench.speculative import prompt_sets  # noqa: E402


def first_token_rates(p: torch.Tensor, q_logits: torch.Tensor, temperature: float,
                      top_p: float, draws: int, gen: torch.Generator) -> dict[str, float]:
    """The keep probabilities of the first draft token at one position (module doc)."""
    ids, probs = proposal_q(q_logits[None], temperature, 0, top_p)
    ids, probs = ids[0], probs[0]
    q = torch.zeros_like(p).index_put_((ids,), probs)
    order = q_logits.argsort(descending=True)
    out = {"guesses": float(p[order[0]]), "guesses top2": float(p[order[:2]].sum()),
           "guesses top3": float(p[order[:3]].sum()),
           "rejection": float(torch.minimum(p, q).sum())}
    support = torch.nonzero((p > 0) | (q > 0))[:, 0]
    e = torch.empty(draws, len(support)).exponential_(generator=gen)
    same = (p[support] / e).argmax(-1) == (q[support] / e).argmax(-1)
    out["coupled"] = float(same.float().mean())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--sets", default="eval,unseen")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draws", type=int, default=256)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)  # the answers' sampling (transformers' generate)
    folder = BUNDLED_DRAFT if args.draft == "default" else Path(args.draft)
    path = resolve_model(args.model)
    tok = TextTokenizer.for_model(path)
    ckpt = open_checkpoint(path)
    target = load_layer_range(ckpt, 0, ckpt.config.num_layers, torch.float32, "cpu")
    cfg = read_dflash_config(folder)
    draft = load_dflash(folder, cfg, torch.float32, "cpu")
    head, embed = target.lm_head.weight.float(), target.embed_tokens.weight.float()
    gen = torch.Generator().manual_seed(1)
    print(f"temperature {args.temperature}, top-p {args.top_p}, answers of up to "
          f"{args.new_tokens} tokens; the first draft token's keep probability, mean over "
          "positions")
    print("| set | positions | " + " | ".join(
        ["guesses", "guesses top2", "guesses top3", "coupled", "rejection"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, convs in prompt_sets(args.sets.split(",")).items():
        prompts = [tok.encode_chat(m) for m in convs]
        seqs = continuations(target, prompts, args.new_tokens, args.temperature, 16, "cpu",
                             ckpt.config.eos_token_ids[0], tuple(tok.eos_ids))
        sums: dict[str, float] = {}
        count = 0
        with torch.inference_mode():
            rows = target_rows(target, seqs, [len(pr) for pr in prompts],
                               list(cfg.target_layer_ids), "cpu")
            for i, (pr, s) in enumerate(zip(prompts, seqs)):
                feats, tokens, final = rows.batch(torch.tensor([i]))
                anchors = torch.arange(len(pr) - 1, len(s) - 1)[None]
                if anchors.numel() == 0:
                    continue
                ql = block_logits(draft, head, embed, feats.float(), tokens, anchors,
                                  cfg.block_size, cfg.mask_token_id)[0, :, 0]
                pl = final[0, anchors[0]].float() @ head.T
                pp = filtered_probs(pl, args.temperature, 0, args.top_p)
                for a in range(anchors.shape[1]):
                    r = first_token_rates(pp[a], ql[a], args.temperature, args.top_p,
                                          args.draws, gen)
                    for k, v in r.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
        print(f"| {name} | {count} | " + " | ".join(
            f"{sums[k] / max(count, 1):.3f}" for k in
            ("guesses", "guesses top2", "guesses top3", "coupled", "rejection")) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
