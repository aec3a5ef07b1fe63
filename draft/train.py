"""Train a DFlash-style draft for a target model, on one GPU, in minutes.

    python -m draft.train --target default --out draft/weights/smollm2-135m-dflash \\
        --device cuda:0 --seconds 240

Data, all offline: chat prompts (`draft.prompts`) answered by the target itself, greedy and
sampled (its own continuations are what the draft must predict), and Python source files found on
the machine, continued by the target. Every sequence then runs through the target once
(batched), for the rows of the tapped layers (the draft's context) and the target's
distribution at every position, which the draft learns (KL); a greedy verify keeps a draft token
exactly when it is that distribution's argmax.

Each training example is a block: an anchor position a, the block [token at a, mask × (B-1)] at
positions a..a+B-1, the context rows of positions < a, and the target's distributions for
positions a+1..a+B-1, weighted by exp(-(k-1)/4) for the k-th draft token (a later one only
counts once the earlier ones were accepted). Many blocks of one sequence train at once under an
attention mask.

Reports the tokens per verify step the draft would reach on held-out prompts
(`draft.prompts.EVAL_*`, decoded as the runtime decodes), keeps the best state by that measure,
and writes the draft in the published DFlash layout (config.json + model.safetensors).
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

from draft.dflash import DFlashDraft, dflash_config_dict, read_dflash_config_dict, save_dflash
from draft.prompts import EVAL_CHAT, EVAL_CODE, training_prompts
from runtime.model_store import resolve_model
from runtime.tokenizer import TextTokenizer
from shards.checkpoint import load_layer_range, open_checkpoint
from shards.hf_convert import hf_causal_lm
from shards.model import LayerRange, apply_rope, rope_cos_sin

log = logging.getLogger("layersplit.train")


# ---- data ----------------------------------------------------------------------------------------
def python_sources(limit_chars: int, seed: int) -> list[str]:
    """Python files of this machine's standard library and site-packages."""
    roots = [sysconfig.get_paths()["stdlib"], *site.getsitepackages()]
    files = []
    for r in roots:
        for dp, _, fn in os.walk(r):
            files += [os.path.join(dp, f) for f in fn if f.endswith(".py")]
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
                  eos_ids: tuple[int, ...]) -> list[list[int]]:
    """The target's continuation of each prompt (batched, transformers' generate)."""
    hf = hf_causal_lm(target, device, next(target.parameters()).dtype,
                      max(len(p) for p in prompts) + new_tokens)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(group):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0,
                    "top_k": 0} if temperature > 0 else {"do_sample": False}
        gen = hf.generate(ids.to(device), attention_mask=mask.to(device),
                          max_new_tokens=new_tokens, pad_token_id=pad_id,
                          eos_token_id=list(eos_ids) or None, **sampling)
        for j, p in enumerate(group):
            cont = gen[j, width:].tolist()
            for k, t in enumerate(cont):
                if t in eos_ids:
                    cont = cont[:k + 1]
                    break
            out.append(p + cont)
        log.info("generated %d / %d continuations", len(out), len(prompts))
    del hf
    return out


@torch.inference_mode()
def target_rows(target: LayerRange, seqs: list[list[int]], taps: list[int], device: str,
                batch: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features (N, T, F), final hidden rows (N, T, H), lengths (N,)) of every sequence: the
    tapped layers' rows at every position (the draft's context; HF's hidden_states[layer + 1]
    is the runtime's tap of `layer`) and the target's normed last hidden rows, whose LM-head
    logits are the distribution the draft learns (the argmax is the token it must match)."""
    n, width = len(seqs), max(len(s) for s in seqs)
    cfg = target.cfg
    dtype = next(target.parameters()).dtype
    hf = hf_causal_lm(target, device, dtype, width)
    feats = torch.zeros(n, width, len(taps) * cfg.hidden_size, dtype=dtype, device=device)
    final = torch.zeros(n, width, cfg.hidden_size, dtype=dtype, device=device)
    order = sorted(range(n), key=lambda i: len(seqs[i]))  # similar lengths batch together
    for b in range(0, n, batch):
        idx = order[b:b + batch]
        w = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), w, dtype=torch.long)
        for j, i in enumerate(idx):  # right padding: rows of real tokens never see it
            ids[j, :len(seqs[i])] = torch.tensor(seqs[i])
        out = hf.model(ids.to(device), output_hidden_states=True)
        feats[idx, :w] = torch.cat([out.hidden_states[t + 1] for t in taps], dim=-1)
        final[idx, :w] = out.last_hidden_state
    del hf
    return feats, final, torch.tensor([len(s) for s in seqs], device=device)


def greedy_labels(final: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The target's argmax token after every position (N, T)."""
    return torch.stack([(f.float() @ head.float().T).argmax(-1) for f in final])


# ---- the training forward (batched; the same math as DFlashDraft.block with context) -----------
def block_logits(draft: DFlashDraft, head: torch.Tensor, embed: torch.Tensor,
                 feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 block: int, mask_id: int) -> torch.Tensor:
    """Logits (b, m, block - 1, V) of the draft tokens of m blocks per sequence.

    feats (b, T, F): context rows; tokens (b, T): the sequences; anchors (b, m): each block's
    first position. Block j sees context rows < anchors[j] and its own rows."""
    b, t_len, _ = feats.shape
    m = anchors.shape[1]
    dev = feats.device
    cfg = draft.cfg.model
    g, d = cfg.num_kv_heads, cfg.head_dim
    pos_q = (anchors[:, :, None] + torch.arange(block, device=dev)).reshape(b, m * block)
    ids = torch.full((b, m, block), mask_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.reshape(b, m * block), embed) * draft.cfg.embedding_scale
    ctx = draft.context(feats)  # (b, T, H)
    pos_c = torch.arange(t_len, device=dev)
    seen_ctx = pos_c[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    blk = torch.arange(m, device=dev).repeat_interleave(block)
    seen_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    mask = torch.cat([seen_ctx, seen_blk], dim=-1)[:, None]  # (b, 1, mB, T + mB)
    cos_q, sin_q = rope_cos_sin(draft.inv_freq, pos_q.reshape(-1), x.dtype)
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        kc, vc = draft.context_kv(ctx.reshape(b * t_len, -1), pos_c.repeat(b), i)
        h = layer.input_layernorm(x).reshape(b * m * block, -1)
        q, k, v = attn.project(h)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_q, sin_q)
        keys = torch.cat([kc.reshape(b, t_len, g, d), k.reshape(b, m * block, g, d)], dim=1)
        vals = torch.cat([vc.reshape(b, t_len, g, d), v.reshape(b, m * block, g, d)], dim=1)
        out = F.scaled_dot_product_attention(
            q.reshape(b, m * block, -1, d).transpose(1, 2), keys.transpose(1, 2),
            vals.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, m * block, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hid = draft.norm(x).reshape(b, m, block, -1)[:, :, 1:]
    return hid @ head.T


def sample_anchors(lengths: torch.Tensor, starts: torch.Tensor, m: int, block: int,
                   gen: torch.Generator) -> torch.Tensor:
    """m anchors per sequence in [max(1, start - 8), length - block]."""
    lo = (starts - 8).clamp_min(1)
    hi = (lengths - block).clamp_min(lo + 1)
    u = torch.rand(len(lengths), m, generator=gen, device=lengths.device)
    return (lo[:, None] + (u * (hi - lo)[:, None]).long()).clamp_max((lengths - block)[:, None])


@torch.no_grad()
def acceptance(draft: DFlashDraft, head, embed, feats, tokens, labels, lengths, starts,
               block: int, mask_id: int) -> float:
    """Tokens per verify step the runtime would commit decoding these (greedy) continuations:
    walk each one as the runtime does, a verify at the position after the last committed
    token, which commits 1 + the run of leading draft tokens equal to the target's."""
    committed, verifies = 0, 0
    for i in range(len(lengths)):
        lo, hi = int(starts[i]), int(lengths[i]) - block + 1
        if hi <= lo:
            continue
        a = torch.arange(lo, hi, device=feats.device)
        logits = block_logits(draft, head, embed, feats[i:i + 1], tokens[i:i + 1], a[None],
                              block, mask_id)[0]
        want = labels[i][a[:, None] + torch.arange(block - 1, device=a.device)]
        runs = (logits.argmax(-1) == want).int().cumprod(-1).sum(-1).tolist()
        pos = 0
        while pos < len(runs):
            committed += runs[pos] + 1
            verifies += 1
            pos += runs[pos] + 1
    return committed / max(verifies, 1)


def init_draft(target: LayerRange, cfg_raw: dict, path: Path) -> DFlashDraft:
    """Draft layers start as copies of the target's last layers; fc starts by passing the last
    tapped layer's rows through."""
    cfg = read_dflash_config_dict(cfg_raw, path)
    draft = DFlashDraft(cfg)
    src = target.layers[-cfg.model.num_layers:]
    with torch.no_grad():
        for mine, theirs in zip(draft.layers, src):
            state = {k: v for k, v in theirs.state_dict().items()}
            missing, _ = mine.load_state_dict(state, strict=False)
            assert all("norm" in k for k in missing), missing
        h = cfg.model.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.eye(h)
        draft.fc.weight.add_(0.01 * torch.randn_like(draft.fc.weight))
        if target.norm is not None:
            draft.norm.weight.copy_(target.norm.weight.float())
    return draft


def optimize(loss: torch.Tensor, params: list, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One step: backward, gradient norm clipped at 1, update."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ---- a classic draft: the target's first layers, distilled ---------------------------------------
def train_classic(target: LayerRange, tok: TextTokenizer, tokens: torch.Tensor,
                  lengths: torch.Tensor, layers: int, seconds: float, out: Path, device: str,
                  lr: float, seed: int) -> Path:
    """A small model with the target's tokenizer: its first `layers` layers, final norm and
    embeddings, the layers trained to match the target's next-token distribution (KL) on the
    same sequences. Written as an HF folder (with the tokenizer), usable as `--draft`."""
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
    hf_t = hf_causal_lm(target, device, next(target.parameters()).dtype, tokens.shape[1])
    hf_d = hf_causal_lm(draft, device, torch.float32, tokens.shape[1]).train()
    # the HF modules hold their own Parameter objects over the LayerRange's storage: train those
    params = [q for name, q in hf_d.named_parameters()
              if "embed_tokens" not in name and "lm_head" not in name]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(seed)
    amp = device.startswith("cuda")
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        idx = torch.randint(0, len(tokens), (16,), generator=gen, device=device)
        n = int(lengths[idx].max())
        ids = tokens[idx, :n]
        mask = (torch.arange(n, device=device)[None] < lengths[idx][:, None]).float()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="HF folder, .gguf, or 'default'")
    p.add_argument("--out", required=True, help="folder to write the draft to")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", type=float, default=240.0, help="training time")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--taps", default=None, help="target layers, e.g. 1,10,19,28 (default: "
                   "spread over the model)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=None, help="draft FFN width (default: "
                   "the target's)")
    p.add_argument("--prompts", type=int, default=3400, help="chat prompts to answer greedily")
    p.add_argument("--sampled", type=float, default=0.5, help="share of them answered again, "
                   "sampled")
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--code-files", type=int, default=600, help="source files to continue")
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--batch", type=int, default=24, help="sequences per step")
    p.add_argument("--anchors", type=int, default=24, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the metrics as JSON here")
    p.add_argument("--classic-out", default=None, help="also distil a classic draft (the "
                   "target's first layers) on the same data, into this folder")
    p.add_argument("--classic-layers", type=int, default=4)
    p.add_argument("--classic-seconds", type=float, default=90.0)
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
    mask_id = next((i for i in range(min(64, tcfg.vocab_size)) if tok.token_text(i) and
                    tok.token_text(i) not in ("<|im_start|>", "<|im_end|>") and
                    tok.token_text(i).startswith("<")), 0)
    log.info("target %s: %d layers; taps %s; block %d; mask token %d (%r)", Path(str(
        model_path)).name, tcfg.num_layers, taps, args.block, mask_id, tok.token_text(mask_id))

    # -- sequences: the target's own answers and continuations --------------------------------
    chat = [tok.encode_chat([{"role": "user", "content": q}])
            for q in training_prompts(args.prompts, args.seed)]
    rng = random.Random(args.seed)
    code = []
    for text in python_sources(args.code_files * 6000, args.seed)[:args.code_files]:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) > 160:
            a = rng.randrange(0, len(ids) - 128)
            code.append(ids[a:a + rng.choice((48, 64, 96, 128))])
    sampled = chat[:int(len(chat) * args.sampled)]
    pad = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else 0
    t0 = time.perf_counter()
    seqs = continuations(target, chat, args.new_tokens, 0.0, args.gen_batch, dev, pad, eos)
    seqs += continuations(target, sampled, args.new_tokens, 0.8, args.gen_batch, dev, pad, eos)
    seqs += continuations(target, code, args.new_tokens // 2, 0.0, args.gen_batch, dev, pad, ())
    starts = [len(q) for q in chat + sampled + code]
    for s_ in (seqs[0], seqs[len(chat)], seqs[-1]):
        log.info("sample: %r", tok.decode(s_)[-300:])
    log.info("%d sequences (%d tokens) in %.0f s", len(seqs), sum(map(len, seqs)),
             time.perf_counter() - t0)
    evals = [tok.encode_chat([{"role": "user", "content": q}]) for q in EVAL_CHAT + EVAL_CODE]
    eval_seqs = continuations(target, evals, args.new_tokens, 0.0, args.gen_batch, dev, pad, eos)
    keep = [i for i, s_ in enumerate(seqs) if len(s_) >= starts[i] + args.block + 1]
    seqs, starts = [seqs[i] for i in keep], [starts[i] for i in keep]

    t0 = time.perf_counter()
    head = target.lm_head.weight.detach()
    embed = target.embed_tokens.weight.detach()
    feats, final, lengths = target_rows(target, seqs, taps, dev)
    ev_feats, ev_final, ev_lengths = target_rows(target, eval_seqs, taps, dev)
    ev_labels = greedy_labels(ev_final, head)
    del ev_final
    tokens = torch.zeros(len(seqs), feats.shape[1], dtype=torch.long, device=dev)
    for i, s_ in enumerate(seqs):
        tokens[i, :len(s_)] = torch.tensor(s_)
    ev_tokens = torch.zeros(len(eval_seqs), ev_feats.shape[1], dtype=torch.long, device=dev)
    for i, s_ in enumerate(eval_seqs):
        ev_tokens[i, :len(s_)] = torch.tensor(s_)
    starts_t = torch.tensor(starts, device=dev)
    ev_starts = torch.tensor([len(q) for q in evals], device=dev)
    log.info("target rows in %.0f s", time.perf_counter() - t0)

    # -- train --------------------------------------------------------------------------------
    out = Path(args.out)
    raw = dflash_config_dict(tcfg, layers=args.layers, taps=taps, block_size=args.block,
                             mask_token_id=mask_id, intermediate_size=args.intermediate)
    draft = init_draft(target, raw, out / "config.json").to(dev)
    embed, head = embed.float(), head.float()
    params = [q for q in draft.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = torch.exp(-torch.arange(args.block - 1, device=dev) / 4.0)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    amp = dev.startswith("cuda")

    def ev() -> float:
        draft.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            tau = acceptance(draft, head, embed, ev_feats, ev_tokens, ev_labels, ev_lengths,
                             ev_starts, args.block, mask_id)
        draft.train()
        return tau

    best = tau0 = ev()
    best_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    log.info("before training: %.2f tokens per verify on %d held-out prompts", tau0, len(evals))
    step, t0 = 0, time.perf_counter()
    history = []
    batch_rows = torch.arange(args.batch, device=dev)[:, None, None]
    offsets = torch.arange(args.block - 1, device=dev)
    while time.perf_counter() - t0 < args.seconds:
        frac = (time.perf_counter() - t0) / args.seconds
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi *
                                                                              frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(seqs), (args.batch,), generator=gen, device=dev)
        n = int(lengths[idx].max())
        anchors = sample_anchors(lengths[idx], starts_t[idx], args.anchors, args.block, gen)
        at = anchors[:, :, None] + offsets  # rows whose next token each draft token predicts
        with torch.no_grad():  # the target's distribution there (distillation, not one label)
            want = F.log_softmax(final[idx][batch_rows, at].float() @ head.T, -1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = block_logits(draft, head, embed, feats[idx, :n].float(), tokens[idx, :n],
                                  anchors, args.block, mask_id)
        kl = F.kl_div(F.log_softmax(logits.float(), -1), want, log_target=True,
                      reduction="none").sum(-1)
        loss = optimize((kl * weights).sum(-1).mean() / weights.sum(), params, opt)
        step += 1
        if step % 250 == 0:
            tau = ev()
            history.append({"step": step, "loss": round(loss.item(), 4), "acceptance": tau})
            if tau > best:
                best = tau
                best_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
            log.info("step %d, %.0f s: KL %.3f, held-out %.2f tokens per verify (best %.2f)",
                     step, time.perf_counter() - t0, loss.item(), tau, best)
    tau = ev()
    if tau < best:
        draft.load_state_dict(best_state)
    log.info("trained %d steps in %.0f s: held-out %.2f tokens per verify (last %.2f, "
             "untrained %.2f)", step, time.perf_counter() - t0, max(tau, best), tau, tau0)
    save_dflash(draft.cpu(), raw, out)
    report = {"target": Path(str(model_path)).name, "taps": taps, "block": args.block,
              "layers": args.layers, "steps": step, "train_seconds": args.seconds,
              "sequences": len(seqs), "acceptance_before": tau0, "acceptance": max(tau, best),
              "history": history, "total_seconds": time.perf_counter() - t00}
    if args.classic_out:
        del feats, ev_feats, final
        train_classic(target, tok, tokens, lengths, args.classic_layers, args.classic_seconds,
                      Path(args.classic_out), dev, args.lr, args.seed)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    log.info("wrote %s (%.1f MB) in %.0f s in all", out,
             (out / "model.safetensors").stat().st_size / 1e6, time.perf_counter() - t00)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
