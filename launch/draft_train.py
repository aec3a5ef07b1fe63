"""Train a DFlash-style draft for a target model, on one GPU, in minutes.

    python -m layersplit.launch.draft_train --target default \\
        --out draft/weights/smollm2-135m-dflash --device cuda:0 --layers 3 --intermediate 1024 \\
        --seconds 300

Data, all offline, all the target's own text (its continuations are what the draft must
predict): its greedy answers to template chat prompts (`draft.prompts`) and to user turns it
writes itself (sampled from the chat template up to a user message's text: the Magpie recipe,
thousands of distinct prompts), its continuations of Python source files found on the
machine, and a quarter of the chat prompts answered again, sampled (last: a generation budget,
`--gen-seconds`, cuts what it has not reached). `--save-data` keeps the sequences
(token ids, safetensors) and `--data` trains on saved ones instead of generating: several GPUs
can generate disjoint shares at once (`--part I/N`) and every one of them train on all of them.
Every sequence then runs through the target once (batched), for the rows of the tapped layers
(the draft's context) and the target's distribution at every position, which the draft learns
(KL); a greedy verify keeps a draft token exactly when it is that distribution's argmax.
`--init DIR` goes on training a written draft (its config fixes the shape), e.g. with a lower
`--lr`: the learning rate warms up and decays on a cosine every run.

Each training example is a block: an anchor position a, the block [token at a, mask × (B-1)] at
positions a..a+B-1, the context rows of positions < a, and the target's distributions for
positions a+1..a+B-1, weighted by exp(-(k-1)/4) for the k-th draft token (a later one only
counts once the earlier ones were accepted). Many blocks of one sequence train at once under an
attention mask.

Measures the tokens per verify step the draft would reach (decoding greedy answers as the
runtime decodes) on held-out answers to user turns the target wrote (`--val`), keeps the best
state by that measure, reports it on the evaluation prompts (`draft.prompts.EVAL_*`, which the
benchmark uses and which never choose the state), and writes the draft in the published DFlash
layout (config.json + model.safetensors).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import site
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from layersplit.draft.dflash import DFlashDraft, dflash_config_dict, save_dflash
from layersplit.draft.dflash_config import read_dflash_config, read_dflash_config_dict
from layersplit.draft.measure import (
    TREE_TOP_K,
    Rows,
    acceptance,
    block_logits,
    greedy_labels,
    label_ranks,
    sample_anchors,
    target_rows,
    walk,
)
from layersplit.draft.prompts import EVAL_CHAT, EVAL_CODE, training_prompts
from layersplit.draft.tree_shape import choose_shape
from layersplit.runtime.model_store import resolve_model
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.hf_convert import hf_causal_lm
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import LayerRange

log = logging.getLogger("layersplit.train")


# ---- data ----------------------------------------------------------------------------------------
SENTINEL = "\x00USER-TURN\x00"


def python_sources(limit_chars: int, seed: int) -> list[str]:
    """Python files of this machine's standard library and site-packages."""
    roots = [sysconfig.get_paths()["stdlib"], *site.getsitepackages()]
    files = []
    for r in roots:
        for dp, _, fn in os.walk(r):
            files += [os.path.join(dp, f) for f in fn if f.endswith(".py")]
    files.sort()
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for f in files:
        if total >= limit_chars:
            break
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 500 < len(text) < 200_000:
            out.append(text)
            total += len(text)
    return out


@torch.inference_mode()
def continuations(target: LayerRange, prompts: list[list[int]], new_tokens: int,
                  temperature: float, batch: int, device: str, pad_id: int,
                  eos_ids: tuple[int, ...], deadline: float | None = None) -> list[list[int]]:
    """The target's continuation of each prompt (batched, transformers' generate), in the
    prompts' order. Past `deadline` (time.perf_counter()) no new batch starts: the result is
    then the continuations of the first prompts only."""
    if not prompts:
        return []
    hf = hf_causal_lm(target, device, next(target.parameters()).dtype,
                      max(len(p) for p in prompts) + new_tokens)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        if deadline is not None and time.perf_counter() > deadline:
            log.warning("generation budget spent: %d of %d prompts answered", len(out),
                        len(prompts))
            break
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0,
                    "top_k": 0} if temperature > 0 else {"do_sample": False}
        gen = hf.generate(ids.to(device), attention_mask=mask.to(device),
                          max_new_tokens=new_tokens, pad_token_id=pad_id,
                          eos_token_id=list(eos_ids) or None, **sampling).tolist()
        for row, p in enumerate(group):
            cont = gen[row][width:]
            for k, t in enumerate(cont):
                if t in eos_ids:
                    cont = cont[:k + 1]
                    break
            out.append(p + cont)
        log.info("generated %d / %d continuations (%.0f s)", len(out), len(prompts),
                 time.perf_counter() - t0)
    del hf
    return out


def user_turn_prefix(tok: TextTokenizer) -> list[int]:
    """The chat template's tokens up to where a user message's text begins."""
    text = tok.render_chat([{"role": "user", "content": SENTINEL}])
    return tok.encode(text[:text.index(SENTINEL)], add_special_tokens=False)


def self_written_prompts(target: LayerRange, tok: TextTokenizer, n: int, batch: int,
                         device: str, pad_id: int, eos_ids: tuple[int, ...],
                         max_tokens: int = 64) -> list[str]:
    """User turns the target writes itself (the Magpie recipe): the chat template up to a user
    message's text, sampled at temperature 1 until the turn ends. Kept: turns that ended, of 3
    words or more, each once. Diverse prompts, all offline, in the target's own domain."""
    prefix = user_turn_prefix(tok)
    seqs = continuations(target, [prefix] * n, max_tokens, 1.0, batch, device, pad_id, eos_ids)
    seen: set[str] = set()
    out = []
    for s in seqs:
        turn = s[len(prefix):]
        if not turn or turn[-1] not in eos_ids:
            continue
        text = tok.decode(turn[:-1]).strip()
        if len(text.split()) >= 3 and text not in seen:
            seen.add(text)
            out.append(text)
    return out


Part = tuple[list[list[int]], list[int]]  # sequences, and where each one's generated part starts


def save_sequences(path: Path, parts: dict[str, Part]) -> None:
    """Named sets of sequences (token ids; uint16 where they fit) as safetensors, no pickle."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (seqs, starts) in parts.items():
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
        if flat.numel() and int(flat.max()) < 65536 and int(flat.min()) >= 0:
            flat = flat.to(torch.uint16)
        tensors |= {f"{name}.tokens": flat, f"{name}.lengths": torch.tensor([len(s) for s in seqs]),
                    f"{name}.starts": torch.tensor(starts, dtype=torch.long)}
    save_file(tensors, str(path))


def load_sequences(path: Path) -> dict[str, Part]:
    """What `save_sequences` wrote; a file of another shape is refused, naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path}: not a sequence file of launch.draft_train ({e})") from e
    parts: dict[str, Part] = {}
    for name in sorted({k.rsplit(".", 1)[0] for k in data}):
        try:
            flat, lengths, starts = (data[f"{name}.{x}"] for x in ("tokens", "lengths", "starts"))
        except KeyError as e:
            raise ValueError(f"{path}: set {name!r} lacks {e}") from e
        if (flat.ndim != 1 or lengths.ndim != 1 or lengths.shape != starts.shape
                or int(lengths.sum()) != flat.numel() or bool((lengths <= 0).any())
                or bool((starts < 0).any()) or bool((starts > lengths).any())):
            raise ValueError(f"{path}: set {name!r}: tokens, lengths and starts disagree")
        seqs = [s.tolist() for s in torch.split(flat.long(), lengths.tolist())]
        parts[name] = (seqs, starts.tolist())
    return parts


def init_draft(target: LayerRange, cfg_raw: dict, path: Path) -> DFlashDraft:
    """Draft layers start as copies of the target's last layers (a narrower FFN keeps the first
    of the target's neurons); fc starts by passing the last tapped layer's rows through."""
    cfg = read_dflash_config_dict(cfg_raw, path)
    draft = DFlashDraft(cfg)
    src = target.layers[-cfg.model.num_layers:]
    with torch.no_grad():
        for mine, theirs in zip(draft.layers, src):
            want = mine.state_dict()
            for k, v in theirs.state_dict().items():
                if k in want:  # the overlap of the two shapes (an FFN of another width)
                    sl = tuple(slice(0, min(a, b)) for a, b in zip(want[k].shape, v.shape))
                    want[k][sl].copy_(v[sl])
            missing = [k for k in want if k not in theirs.state_dict()]
            assert all("norm" in k for k in missing), missing
        h = cfg.model.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.eye(h)
        draft.fc.weight.add_(0.01 * torch.randn_like(draft.fc.weight))
        if target.norm is not None:
            draft.norm.weight.copy_(target.norm.weight.float())
    return draft


def start_config(args: argparse.Namespace, target: ModelConfig) -> tuple[list[int], int]:
    """--init: the draft's shape is that of the draft to go on training (set in `args`);
    returns its taps and mask token. A draft of another target is refused by name."""
    path = Path(args.init)
    try:
        cfg = read_dflash_config(path)
        cfg.check_target(target, path / "config.json")
    except CheckpointError as e:
        raise SystemExit(f"launch.draft_train: --init: {e}") from e
    args.layers, args.block = cfg.model.num_layers, cfg.block_size
    args.intermediate = cfg.model.intermediate_size
    return list(cfg.target_layer_ids), cfg.mask_token_id


def optimize(loss: torch.Tensor, params: list, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One step: backward, gradient norm clipped at 1, update."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ---- a classic draft: the target's first layers, distilled ---------------------------------------
def train_classic(target: LayerRange, tok: TextTokenizer, rows: Rows, layers: int,
                  seconds: float, out: Path, device: str, lr: float, seed: int,
                  max_steps: int = 0) -> Path:
    """A small model with the target's tokenizer: its first `layers` layers, final norm and
    embeddings, the layers trained to match the target's next-token distribution (KL) on the
    same sequences, for `seconds` (or `max_steps` steps, if sooner). Written as an HF folder
    (with the tokenizer), usable as `--draft`."""
    import dataclasses

    from safetensors.torch import save_file

    tcfg = target.cfg
    cfg = dataclasses.replace(tcfg, num_layers=layers)
    with torch.device("meta"):
        draft = LayerRange(cfg, 0, layers)
    state = {k: v.detach().float().clone() for k, v in target.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    draft.load_state_dict(state, assign=True, strict=True)
    draft.inv_freq = target.inv_freq.clone()
    draft = draft.to(device)
    width = int(rows.lengths.max())
    hf_t = hf_causal_lm(target, device, next(target.parameters()).dtype, width)
    hf_d = hf_causal_lm(draft, device, torch.float32, width).train()
    # the HF modules hold their own Parameter objects over the LayerRange's storage: train those
    params = [q for name, q in hf_d.named_parameters()
              if "embed_tokens" not in name and "lm_head" not in name]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(seed)
    amp = device.startswith("cuda")
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds and not (max_steps and step >= max_steps):
        idx = torch.randint(0, len(rows), (16,), generator=gen, device=device)
        n = int(rows.lengths[idx].max())
        ids = rows.tokens[rows.index(idx, n)]
        mask = (torch.arange(n, device=device)[None] < rows.lengths[idx][:, None]).float()
        with torch.no_grad():
            want = F.log_softmax(hf_t(ids).logits.float(), -1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            got = hf_d(ids).logits
        kl = F.kl_div(F.log_softmax(got.float(), -1), want, log_target=True,
                      reduction="none").sum(-1)
        loss = optimize((kl * mask).sum() / mask.sum(), params, opt)
        step += 1
        if step % 200 == 0:
            log.info("classic draft step %d: KL %.3f", step, float(loss))
    out.mkdir(parents=True, exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLM"] if cfg.model_type in ("llama", "mistral") else
           [f"{cfg.model_type.capitalize()}ForCausalLM"], "model_type": cfg.model_type,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "max_position_embeddings": cfg.max_position_embeddings,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
           "attention_bias": cfg.attention_bias, "eos_token_id": list(tcfg.eos_token_ids)}
    names = {"embed_tokens.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
    weights = {names.get(k, "model." + k): v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in draft.state_dict().items()
               if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    tok.tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template,
        "eos_token": tok.token_text(tok.eos_ids[0]) if tok.eos_ids else None,
        "bos_token": None if tok.bos_id is None else tok.token_text(tok.bos_id)}))
    log.info("classic draft: %d layers, %d steps in %.0f s -> %s", layers, step,
             time.perf_counter() - t0, out)
    return out


def train_dflash(args: argparse.Namespace, target: LayerRange, raw: dict, rows: dict[str, Rows],
                 labels: dict[str, torch.Tensor], mask_id: int, out: Path) -> dict:
    """The DFlash draft of config `raw`, trained on rows["train"] for args.seconds; the best
    state by tokens per verify on rows["val"] is written to `out`. Returns the report's part."""
    dev = args.device
    train = rows["train"]
    draft = init_draft(target, raw, out / "config.json")
    if args.init:  # its shapes are those of `raw` (`start_config`)
        from safetensors.torch import load_file

        try:
            draft.load_state_dict(load_file(str(Path(args.init) / "model.safetensors")))
        except (OSError, RuntimeError) as e:  # (a draft of a shape this trainer does not make)
            raise SystemExit(f"launch.draft_train: --init {args.init}: cannot load its weights "
                             f"into the draft its config describes: {e}") from e
    draft = draft.to(dev)
    fhead = target.lm_head.weight.detach().float()
    fembed = target.embed_tokens.weight.detach().float()
    params = [q for q in draft.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = torch.exp(-torch.arange(args.block - 1, device=dev) / 4.0)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    amp = dev.startswith("cuda")

    def measure(name: str) -> float:
        draft.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            tau = acceptance(draft, fhead, fembed, rows[name], labels[name], args.block,
                             mask_id)
        draft.train()
        return tau

    if len(rows["val"]) == 0:
        log.warning("no held-out answer is long enough for a block: the last state is "
                    "kept, not the best (raise --val or --new-tokens)")
    best = tau0 = measure("val")
    best_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    log.info("before training: %.2f tokens per verify on %d held-out answers", tau0,
             len(rows["val"]))
    step, t0, next_eval = 0, time.perf_counter(), args.eval_every
    history = []
    batch_rows = torch.arange(args.batch, device=dev)[:, None, None]
    offsets = torch.arange(args.block - 1, device=dev)
    while (elapsed := time.perf_counter() - t0) < args.seconds and (
            not args.max_steps or step < args.max_steps):
        frac = max(elapsed / args.seconds, step / args.max_steps if args.max_steps else 0.0)
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(train), (args.batch,), generator=gen, device=dev)
        at_rows = train.index(idx, int(train.lengths[idx].max()))
        anchors = sample_anchors(train.lengths[idx], train.starts[idx], args.anchors,
                                 args.block, gen)
        at = anchors[:, :, None] + offsets  # rows whose next token each draft token predicts
        with torch.no_grad():  # the target's distribution there (distillation)
            want = F.log_softmax(train.final[at_rows[batch_rows, at]].float() @ fhead.T, -1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = block_logits(draft, fhead, fembed, train.feats[at_rows].float(),
                                  train.tokens[at_rows], anchors, args.block, mask_id)
        kl = F.kl_div(F.log_softmax(logits.float(), -1), want, log_target=True,
                      reduction="none").sum(-1)
        loss = optimize((kl * weights).sum(-1).mean() / weights.sum(), params, opt)
        step += 1
        # every eval_every seconds; with a step budget also at each quarter of it, so a run's
        # history does not depend on how fast the machine is
        quarter = args.max_steps and step % max(1, args.max_steps // 4) == 0
        if time.perf_counter() - t0 >= next_eval or quarter:
            if not quarter:
                next_eval += args.eval_every
            tau = measure("val")
            history.append({"step": step, "seconds": round(time.perf_counter() - t0),
                            "loss": round(loss.item(), 4), "val": round(tau, 3)})
            if tau > best:
                best = tau
                best_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
            log.info("step %d, %.0f s: KL %.3f, held-out %.2f tokens per verify (best %.2f)",
                     step, time.perf_counter() - t0, loss.item(), tau, best)
    tau = measure("val")
    if tau >= best:
        best = tau
    else:
        draft.load_state_dict(best_state)
    ev = measure("eval")
    log.info("trained %d steps in %.0f s: %.2f tokens per verify on the held-out answers "
             "(last %.2f, untrained %.2f); %.2f on the %d evaluation prompts", step,
             time.perf_counter() - t0, best, tau, tau0, ev, len(rows["eval"]))
    report = {"steps": step, "train_seconds": args.seconds, "val_before": tau0, "val": best,
              "eval": ev, "history": history}
    if args.tree_nodes:
        draft.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            report |= tree_shape(draft, fhead, fembed, rows, labels, args.block, mask_id,
                                 args.tree_nodes, raw)
    save_dflash(draft.cpu(), raw, out)
    log.info("wrote %s (%.1f MB)", out, (out / "model.safetensors").stat().st_size / 1e6)
    return report


def tree_shape(draft: DFlashDraft, head: torch.Tensor, embed: torch.Tensor,
               rows: dict[str, Rows], labels: dict[str, torch.Tensor], block: int, mask_id: int,
               nodes: int, raw: dict) -> dict:
    """Choose the draft's token tree of `nodes` draft tokens on the held-out answers (set as
    raw["spec_tree"]); returns tokens per verify with it on those and on the evaluation
    prompts."""
    val = label_ranks(draft, head, embed, rows["val"], labels["val"], block, mask_id,
                      TREE_TOP_K)
    shape = choose_shape(val, nodes, TREE_TOP_K)
    if not shape:
        log.warning("no token tree: the held-out answers hold no whole block")
        return {"tree_nodes": 0}
    raw["spec_tree"] = shape
    ev = label_ranks(draft, head, embed, rows["eval"], labels["eval"], block, mask_id,
                     TREE_TOP_K)
    got = {"tree_nodes": len(shape), "val_tree": walk(val, shape), "eval_tree": walk(ev, shape)}
    log.info("token tree of %d draft tokens: %.2f tokens per verify on the held-out answers, "
             "%.2f on the evaluation prompts", len(shape), got["val_tree"], got["eval_tree"])
    return got


def part_arg(text: str) -> tuple[int, int]:
    """`--part I/N`: the I-th (from 0) of N shares."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N, e.g. 0/2, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"I/N needs 0 <= I < N, got {text!r}")
    return i, n


def make_sequences(args: argparse.Namespace, target: LayerRange, tok: TextTokenizer,
                   device: str, pad: int, eos: tuple[int, ...]) -> dict[str, Part]:
    """The training set ("train") and the held-out set that picks the best state ("val"): the
    target's own answers, greedy and sampled, to template prompts (`draft.prompts`) and to user
    turns it writes itself, and its continuations of Python source files. `--part I/N` makes
    the I-th of N disjoint shares (several GPUs generate at once; `--data` joins them)."""
    part, parts = args.part
    seed = args.seed + 1000 * part
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    written = self_written_prompts(target, tok, args.self_prompts // parts + args.val,
                                   args.gen_batch, device, pad, eos)
    val_q, written = written[:args.val], written[args.val:]
    log.info("%d user turns written by the target (%.0f s), e.g. %r", len(written) + len(val_q),
             time.perf_counter() - t0, written[:3])
    templates = training_prompts(args.prompts, args.seed)[part::parts]
    questions = templates + written
    random.Random(seed).shuffle(questions)
    chat = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    rng = random.Random(seed)
    code = []
    files = python_sources(args.code_files * 6000, args.seed)[:args.code_files][part::parts]
    for text in files:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) > 160:
            a = rng.randrange(0, len(ids) - 128)
            code.append(ids[a:a + rng.choice((48, 64, 96, 128))])
    val = [tok.encode_chat([{"role": "user", "content": q}]) for q in val_q]
    val_seqs = continuations(target, val, args.new_tokens, 0.0, args.gen_batch, device, pad, eos)
    deadline = (time.perf_counter() + args.gen_seconds if args.gen_seconds is not None
                else None)
    sampled = chat[:int(len(chat) * args.sampled)]
    # greedy answers first: they are what a greedy verify keeps; a spent budget cuts the rest
    seqs = continuations(target, chat, args.new_tokens, 0.0, args.gen_batch, device, pad, eos,
                         deadline)
    starts = [len(q) for q in chat[:len(seqs)]]
    more = continuations(target, code, args.new_tokens // 2, 0.0, args.gen_batch, device, pad,
                         (), deadline)
    seqs, starts = seqs + more, starts + [len(q) for q in code[:len(more)]]
    more = continuations(target, sampled, args.new_tokens, 0.8, args.gen_batch, device, pad, eos,
                         deadline)
    seqs, starts = seqs + more, starts + [len(q) for q in sampled[:len(more)]]
    for s_ in seqs[:2] + seqs[-1:]:
        log.info("sample: %r", tok.decode(s_)[-300:])
    log.info("%d sequences (%d tokens) in %.0f s", len(seqs), sum(map(len, seqs)),
             time.perf_counter() - t0)
    return {"train": (seqs, starts), "val": (val_seqs, [len(q) for q in val])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layersplit.launch.draft_train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="HF folder, .gguf, or 'default'")
    p.add_argument("--out", default=None, help="folder to write the DFlash draft to")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", type=float, default=300.0, help="training time")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps if sooner (0: time alone decides)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--taps", default=None, help="target layers, e.g. 1,10,19,28 (default: "
                   "spread over the model)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--tree-nodes", type=int, default=31, help="draft tokens of the token tree "
                   "the draft proposes, chosen on the held-out answers (0: none, a chain)")
    p.add_argument("--intermediate", type=int, default=None, help="draft FFN width (default: "
                   "the target's)")
    p.add_argument("--data", default=None, help="comma-separated sequence files (written by "
                   "--save-data) to train on instead of generating")
    p.add_argument("--save-data", default=None, help="write the generated sequences here")
    p.add_argument("--part", type=part_arg, default=(0, 1), help="I/N: generate the I-th (from "
                   "0) of N disjoint shares")
    p.add_argument("--prompts", type=int, default=3400, help="template chat prompts (at most "
                   "the 3,240 that draft.prompts makes)")
    p.add_argument("--self-prompts", type=int, default=24000, help="user turns the target "
                   "writes itself, before removing repeats (shared among the N of --part)")
    p.add_argument("--val", type=int, default=64, help="user turns written besides those, held "
                   "out: their answers pick the best state")
    p.add_argument("--sampled", type=float, default=0.25, help="share of the chat prompts "
                   "answered again, sampled")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--code-files", type=int, default=3000, help="source files to continue")
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--gen-seconds", type=float, default=None, help="budget for generating "
                   "answers (user turns and held-out sets excluded)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--anchors", type=int, default=24, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", default=None, help="go on training this DFlash draft (a folder; "
                   "its config fixes --layers, --taps, --block and --intermediate)")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds between held-out "
                   "measurements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the metrics as JSON here")
    p.add_argument("--classic-out", default=None, help="also distil a classic draft (the "
                   "target's first layers) on the same data, into this folder")
    p.add_argument("--classic-layers", type=int, default=4)
    p.add_argument("--classic-seconds", type=float, default=90.0)
    p.add_argument("--classic-max-steps", type=int, default=0,
                   help="stop the classic draft's training after this many steps if sooner "
                        "(0: time alone decides)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(args.seed)
    t00 = time.perf_counter()
    dev = args.device
    run_dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model_path = resolve_model(args.target)
    ckpt = open_checkpoint(model_path)
    tcfg = ckpt.config
    tok = TextTokenizer.for_model(model_path)
    target = load_layer_range(ckpt, 0, tcfg.num_layers, run_dtype, dev)
    taps = ([int(x) for x in args.taps.split(",")] if args.taps else
            [round(1 + i * (tcfg.num_layers - 3) / 3) for i in range(4)])
    eos = tuple(tok.eos_ids) or tuple(tcfg.eos_token_ids)
    pad = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else 0
    mask_id = next((i for i in range(min(64, tcfg.vocab_size)) if tok.token_text(i) and
                    tok.token_text(i) not in ("<|im_start|>", "<|im_end|>") and
                    tok.token_text(i).startswith("<")), 0)
    if args.init:
        taps, mask_id = start_config(args, tcfg)
    log.info("target %s: %d layers; taps %s; block %d; mask token %d (%r)", Path(str(
        model_path)).name, tcfg.num_layers, taps, args.block, mask_id, tok.token_text(mask_id))

    # -- sequences: the target's own answers and continuations --------------------------------
    if args.data:
        sets: dict[str, Part] = {"train": ([], []), "val": ([], [])}
        for f in args.data.split(","):
            try:
                loaded = load_sequences(Path(f))
            except ValueError as e:
                raise SystemExit(f"launch.draft_train: --data: {e}") from e
            for name, (s_, st) in loaded.items():
                sets.setdefault(name, ([], []))
                sets[name][0].extend(s_)
                sets[name][1].extend(st)
        log.info("loaded %d + %d sequences from %s", len(sets["train"][0]), len(sets["val"][0]),
                 args.data)
    else:
        sets = make_sequences(args, target, tok, dev, pad, eos)
        if args.save_data:
            save_sequences(Path(args.save_data), sets)
            log.info("wrote %s (%.1f MB)", args.save_data,
                     Path(args.save_data).stat().st_size / 1e6)
    if not (args.out or args.classic_out):
        log.info("no --out nor --classic-out: done in %.0f s", time.perf_counter() - t00)
        return 0
    held_out = {tuple(q[:st]) for q, st in zip(*sets["val"])}
    train_seqs, train_starts = sets["train"]
    keep = [i for i, (q, st) in enumerate(zip(train_seqs, train_starts))
            if tuple(q[:st]) not in held_out]
    if len(keep) < len(train_seqs):  # shares generated apart may repeat a user turn
        log.info("left out %d training sequences whose prompt is a held-out one",
                 len(train_seqs) - len(keep))
        sets["train"] = ([train_seqs[i] for i in keep], [train_starts[i] for i in keep])
    evals = [tok.encode_chat([{"role": "user", "content": q}]) for q in EVAL_CHAT + EVAL_CODE]
    sets["eval"] = (continuations(target, evals, args.new_tokens, 0.0, args.gen_batch, dev, pad,
                                  eos), [len(q) for q in evals])

    t0 = time.perf_counter()
    head = target.lm_head.weight.detach()
    rows: dict[str, Rows] = {}
    for name, (s_, st) in sets.items():
        keep = [i for i, q in enumerate(s_) if len(q) >= st[i] + args.block + 1]
        rows[name] = target_rows(target, [s_[i] for i in keep], [st[i] for i in keep], taps, dev)
    train = rows["train"]
    if len(train) == 0:
        raise SystemExit("no training sequence is long enough for a block: generate more "
                         "(--gen-seconds, --new-tokens) or pass --data")
    labels = {k: greedy_labels(rows[k].final, head) for k in ("val", "eval")}
    log.info("target rows of %d + %d + %d sequences (%d train rows) in %.0f s", len(train),
             len(rows["val"]), len(rows["eval"]), len(train.tokens), time.perf_counter() - t0)
    report: dict = {"target": Path(str(model_path)).name, "taps": taps, "block": args.block,
                    "layers": args.layers, "sequences": len(train),
                    "train_tokens": len(train.tokens)}

    if args.out:
        raw = dflash_config_dict(tcfg, layers=args.layers, taps=taps, block_size=args.block,
                                 mask_token_id=mask_id, intermediate_size=args.intermediate)
        report |= train_dflash(args, target, raw, rows, labels, mask_id, Path(args.out))
    if args.classic_out:
        train.feats = train.final = torch.empty(0)  # the DFlash rows: not needed any more
        del rows, labels
        train_classic(target, tok, train, args.classic_layers, args.classic_seconds,
                      Path(args.classic_out), dev, args.lr, args.seed,
                      args.classic_max_steps)
    report["total_seconds"] = time.perf_counter() - t00
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    log.info("done in %.0f s in all", time.perf_counter() - t00)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
