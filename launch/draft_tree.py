"""`python -m layersplit.launch.draft_tree DRAFT --data FILE[,FILE...]`: choose the token tree of a
trained DFlash draft (`draft.tree_shape`) from how often the target's token had each rank on
held-out answers, and write it into the draft's config.json as `spec_tree`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from layersplit.draft.dflash import load_dflash, write_config
from layersplit.draft.dflash_config import read_dflash_config
from layersplit.draft.measure import TREE_TOP_K, greedy_labels, label_ranks, target_rows, walk
from layersplit.draft.tree_shape import choose_shape
from layersplit.launch.draft_train import load_sequences
from layersplit.runtime.model_store import BUNDLED_DRAFT, resolve_model
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint


def main(argv: list[str] | None = None) -> int:
    """Choose the token tree of a trained DFlash draft on held-out answers (sequence files of
    `launch.draft_train --save-data`, their "val" sets) and write it into the draft's
    config.json."""
    p = argparse.ArgumentParser(prog="python -m layersplit.launch.draft_tree",
                                description=main.__doc__)
    p.add_argument("draft", help="a DFlash folder, or 'default' (the bundled draft)")
    p.add_argument("--data", required=True, help="comma-separated sequence files")
    p.add_argument("--nodes", type=int, default=31, help="draft tokens of the tree")
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    folder = BUNDLED_DRAFT if args.draft == "default" else Path(args.draft)
    cfg = read_dflash_config(folder)
    ckpt = open_checkpoint(resolve_model(args.target))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, args.device)
    draft = load_dflash(folder, cfg, torch.float32, args.device).eval()
    seqs, starts = [], []
    for f in args.data.split(","):
        s, st = load_sequences(Path(f))["val"]
        seqs += s
        starts += st
    rows = target_rows(target, seqs, starts, list(cfg.target_layer_ids), args.device)
    rows.feats, rows.final = rows.feats.float(), rows.final.float()
    head = target.lm_head.weight.float()
    embed = target.embed_tokens.weight.float()
    ranks = label_ranks(draft, head, embed, rows, greedy_labels(rows.final, head),
                        cfg.block_size, cfg.mask_token_id, TREE_TOP_K)
    shape = choose_shape(ranks, args.nodes, TREE_TOP_K)
    if not shape:
        p.error(f"{args.data}: its held-out answers hold no whole block of {cfg.block_size}")
    chain = [[0] * d for d in range(1, cfg.block_size)]
    print(f"{len(seqs)} held-out answers: {walk(ranks, chain):.3f} tokens per verify with a "
          f"chain of {cfg.block_size - 1}, {walk(ranks, shape):.3f} with a tree of "
          f"{len(shape)}")
    raw = json.loads((folder / "config.json").read_text())
    raw["spec_tree"] = shape
    write_config(folder, raw)
    print(f"wrote spec_tree into {folder / 'config.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
