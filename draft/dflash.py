"""A DFlash-style block draft: a few Qwen3-style layers conditioned on the target's hidden states.

The rows of the target's tapped layers (`target_layer_ids`) at every committed position are
concatenated, projected by `fc` and normalised (`hidden_norm`): one context row per position.
Every draft layer turns the context rows into keys and values of its own attention (k_proj, the
layer's k_norm and rotary; v_proj), kept in a KV cache like a decoder's. A block
`[last token, mask × (B-1)]` at positions `[p, p + B)` then runs through the layers in one
forward pass, each block row attending every context row and every block row (not causal); the
final norm and the *target's* LM head give logits for positions p+1 .. p+B-1, and tokens are
embedded with the target's embedding. Pure torch, no processes.

Checkpoints use the published DFlash layout (z-lab's): `config.json` (a Qwen3 config plus
`block_size`, `num_target_layers` and `dflash_config: {target_layer_ids, mask_token_id}`; per
layer `layer_types` with `sliding_window`, where a sliding layer's block rows see the keys of
their last `sliding_window` positions and the block causally) and safetensors with `fc.weight`,
`hidden_norm.weight`, `layers.{i}.*` (Qwen3 decoder layer names), `norm.weight`. What the
reference reads and this module does not implement is refused by name (`refuse_unimplemented`).

Shapes: n = context rows, m = block rows, H = hidden, F = len(target_layer_ids) * H.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from layersplit.draft.dflash_config import (
    ARCHITECTURE,
    DFlashConfig,
    default_target_layers,
    read_dflash_config_dict,
)
from layersplit.shards.errors import CheckpointError
from layersplit.shards.fused import post_attention, pre_attention, rms_norm, rope
from layersplit.shards.kv_cache import KVCache
from layersplit.shards.layers.attention import group_queries
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models.llama import DecoderLayer
from layersplit.shards.random_weights import RandomCheckpoint
from layersplit.shards.weights import layer_tensor_shapes
from torch import nn


def dflash_tensor_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Stored tensor name -> shape, in the published layout (no `model.` prefix)."""
    m = cfg.model
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (m.hidden_size, cfg.width),
        "hidden_norm.weight": (m.hidden_size,),
        "norm.weight": (m.hidden_size,),
    }
    for i in range(m.num_layers):
        for name, shape in layer_tensor_shapes(m, i).items():
            shapes[name[len("model."):]] = shape
    return shapes


class DFlashDraft(nn.Module):
    """The draft's own weights. Context rows go in with `write_context`, a block with `block`."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        m = cfg.model
        self.fc = nn.Linear(cfg.width, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(m, i) for i in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(m), persistent=False)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """(n, F) tapped rows -> (n, H) context rows."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor, layer: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after k_norm and rotary) and values of context rows for one layer: (n, G, D)."""
        attn = self.layers[layer].self_attn
        _, k, v = attn.project(ctx)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        cos, sin = rope_cos_sin(self.inv_freq, positions, ctx.dtype)
        return apply_rope(k, cos, sin), v

    def kv_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per layer: the weight (and bias, None without) that maps a context row to its keys
        and values side by side, and the layer's k_norm weight (None without one)."""
        out = []
        for layer in self.layers:
            a = layer.self_attn
            if a.qkv_proj is not None:  # fused (GPU): the k and v rows of the fused weight
                q_rows = a.num_heads * a.head_dim
                w = a.qkv_proj.weight[q_rows:]
                b = None if a.qkv_proj.bias is None else a.qkv_proj.bias[q_rows:]
            else:
                w = torch.cat([a.k_proj.weight, a.v_proj.weight])
                b = None if a.k_proj.bias is None else torch.cat([a.k_proj.bias, a.v_proj.bias])
            out.append((w, b, None if a.k_norm is None else a.k_norm.weight))
        return out

    def write_context(self, feats: torch.Tensor, pos: int, kv: KVCache, slot: int = 0) -> None:
        """Store the keys and values of context rows at positions [pos, pos + n)."""
        ctx = self.context(feats)
        positions = torch.arange(pos, pos + ctx.shape[0], device=ctx.device)
        for i in range(len(self.layers)):
            k, v = self.context_kv(ctx, positions, i)
            kv.k[i, slot, pos:pos + ctx.shape[0]] = k
            kv.v[i, slot, pos:pos + ctx.shape[0]] = v

    def block(self, x: torch.Tensor, step: StepInfo, kv: KVCache, slot: int = 0
              ) -> torch.Tensor:
        """Normed hidden rows (m, H) of a block of embedded tokens x (m, H) at `step`'s
        positions; its keys and values are written to `kv` after the context's."""
        cos, sin = rope_cos_sin(self.inv_freq, step.positions, x.dtype)
        h = x
        steps: dict[tuple[int | None, bool], StepInfo] = {(None, False): step}
        for i, layer in enumerate(self.layers):
            kind = self.cfg.attention(i)
            if kind not in steps:
                keys = torch.arange(step.kv_len, device=x.device)
                mask = block_mask(kind, step.positions, keys)
                steps[kind] = dataclasses.replace(
                    step, mask=mask if step.mask is None else mask & step.mask, windowed={})
            h = layer(h, cos, sin, kv, i, slot, steps[kind])
        return self.norm(h)


def block_mask(kind: tuple[int | None, bool], queries: torch.Tensor, keys: torch.Tensor,
               seen: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys (at positions `keys`, (..., T)) block rows at positions `queries` (..., m)
    see in a layer of `kind` (window, causal): (..., m, T), within `seen` (..., T) where given.
    Causal: keys at most the query's position; a window: keys past q - window."""
    window, causal = kind
    q, k = queries[..., :, None], keys[..., None, :]
    m = k > q - window if window is not None else torch.ones_like(k > q)
    if causal:
        m = m & (k <= q)
    return m if seen is None else m & seen[..., None, :]


def context_kv_all(feats: torch.Tensor, positions: torch.Tensor, fc_w: torch.Tensor,
                   hn_w: torch.Tensor,
                   kv: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
                   inv_freq: torch.Tensor, eps: float, kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`DFlashDraft.context_kv` of every layer at once: keys and values (L, n, G, D). A pure
    function of its weights, so that torch.compile fuses the norms and rotary of all layers
    into a few kernels (the captured step, `draft.proposer`)."""
    ctx = rms_norm(F.linear(feats, fc_w), hn_w, eps)
    cos, sin = rope_cos_sin(inv_freq, positions, ctx.dtype)
    n, ks, vs = ctx.shape[0], [], []
    for w, b, kn in kv:  # (`DFlashDraft.kv_weights`)
        k, v = F.linear(ctx, w, b).view(n, 2, kv_heads, head_dim).unbind(1)
        if kn is not None:
            k = rms_norm(k, kn, eps)
        ks.append(rope(k, cos, sin))
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def head_top(h: torch.Tensor, norm_w: torch.Tensor, head: torch.Tensor, eps: float, k: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, V) of a block's un-normed rows, and the ids of each row's k best (n, k),
    best first."""
    logits = F.linear(rms_norm(h, norm_w, eps), head)
    return logits, logits.topk(k, dim=-1).indices


LayerWeights = tuple  # (ln1, qkv, qkv bias, q_norm, k_norm, o, ln2, gate_up, down): `layer_weights`


def layer_weights(layer: DecoderLayer) -> LayerWeights:
    """A draft layer's weights as `draft_step` takes them: q/k/v and gate/up side by side (the
    fused layer's own tensors on GPUs, concatenated copies of an unfused one's)."""
    a, m = layer.self_attn, layer.mlp
    if a.qkv_proj is not None:
        qkv, qkv_b = a.qkv_proj.weight, a.qkv_proj.bias
    else:
        ps = (a.q_proj, a.k_proj, a.v_proj)
        qkv = torch.cat([x.weight for x in ps])
        qkv_b = None if a.q_proj.bias is None else torch.cat([x.bias for x in ps])
    gu = m.gate_up_proj.weight if m.gate_up_proj is not None else torch.cat(
        [m.gate_proj.weight, m.up_proj.weight])
    return (layer.input_layernorm.weight, qkv, qkv_b,
            None if a.q_norm is None else a.q_norm.weight,
            None if a.k_norm is None else a.k_norm.weight,
            a.o_proj.weight, layer.post_attention_layernorm.weight, gu, m.down_proj.weight)


def _attend(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            scale: float) -> torch.Tensor:
    """Attention of q (m, H, D) over key sets (keys (T, G, D), values (T, G, D), seen (T,) or
    per query (m, T) bool) taken as one, without joining them: GQA as `Attention._grouped`.
    (m, H * D)."""
    m, nh, d = q.shape
    g = parts[0][0].shape[1]
    r = nh // g
    qg = group_queries(q, g)  # (G, r*m, D): row i * m + j is query j's i-th head of the group
    scores = [torch.matmul(qg, k.permute(1, 2, 0)).masked_fill(
        ~(seen if seen.dim() == 1 else seen.repeat(r, 1)), float("-inf"))
        for k, _, seen in parts]
    probs = torch.softmax(torch.cat(scores, -1).float() * scale, dim=-1).to(q.dtype)
    out, a = None, 0
    for (k, v, _), s in zip(parts, scores):
        o = torch.matmul(probs[..., a:a + s.shape[-1]], v.transpose(0, 1))  # (G, r*m, D)
        out, a = o if out is None else out + o, a + s.shape[-1]
    return out.view(g, r, m, d).permute(2, 0, 1, 3).reshape(m, -1)


def draft_step(feats: torch.Tensor, done: torch.Tensor, pos: torch.Tensor, known: torch.Tensor,
               ids: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, embed: torch.Tensor,
               fc_w: torch.Tensor, hn_w: torch.Tensor, kv: list, layers: list[LayerWeights],
               inv_freq: torch.Tensor, norm_w: torch.Tensor, head: torch.Tensor, eps: float,
               heads: int, kv_heads: int, head_dim: int, emb_scale: float, k: int,
               kinds: tuple = ()) -> tuple[torch.Tensor, ...]:
    """A whole proposal's step as a pure function of fixed shapes (captured, and compiled on
    GPUs, by `draft.proposer`): the context rows [done, done + m) projected from `feats` (the
    slot's feature store, (S, F)), then the block `ids` (m,) at [pos, pos + m) through every
    layer, then the head and each row's k best.

    Each block row attends the cached keys below `done` (`cache_k/v`: (L, T, G, D), T a bucket
    of the cache), the new context rows below `pos` and every block row, context rows only
    where `known` (the slot's, (>= T,) bool) holds (`DFlashProposer.gap`: rows that never came
    are False); nothing is written
    here. Returns the new context rows' keys and values (L, m, G, D), for the caller to store
    at [done, done + m), the logits (m - 1, V) and the top-k ids (m - 1, k). The same math as
    `DFlashDraft.write_context` + `block` + the head, in another order of sums. `kinds`: each
    layer's (window, causal) (`DFlashConfig.attention`; empty: all (None, False))."""
    m, dev = ids.shape[0], ids.device
    rows = torch.arange(m, device=dev)
    ctx_pos = done + rows
    ck, cv = context_kv_all(feats.index_select(0, ctx_pos.clamp_max(feats.shape[0] - 1)),
                            ctx_pos, fc_w, hn_w, kv, inv_freq, eps, kv_heads, head_dim)
    keys = torch.arange(cache_k.shape[1], device=dev)
    seen_cache = (keys < done) & known[:cache_k.shape[1]]
    seen_ctx = (ctx_pos < pos) & known[ctx_pos.clamp_max(known.shape[0] - 1)]
    seen_block = torch.ones(m, dtype=torch.bool, device=dev)
    h = F.embedding(ids, embed)
    if emb_scale != 1.0:
        h = h * emb_scale
    cos, sin = rope_cos_sin(inv_freq, pos + rows, h.dtype)
    scale = head_dim ** -0.5
    plain = (seen_cache, seen_ctx, seen_block)
    masks = {}  # (a plain loop: the compiled step traces it)
    for kind in kinds:
        if kind != (None, False) and kind not in masks:
            masks[kind] = (block_mask(kind, pos + rows, keys, seen_cache),
                           block_mask(kind, pos + rows, ctx_pos, seen_ctx),
                           block_mask(kind, pos + rows, pos + rows))
    for i, (ln1, qkv, qkv_b, qn, kn, o, ln2, gu, down) in enumerate(layers):
        q, kb, vb = pre_attention(h, ln1, qkv, qkv_b, qn, kn, cos, sin, eps, heads, kv_heads,
                                  head_dim)
        sc, sx, sb = masks.get(kinds[i], plain) if kinds else plain
        attn = _attend(q, [(cache_k[i], cache_v[i], sc), (ck[i], cv[i], sx), (kb, vb, sb)],
                       scale)
        h = post_attention(h, attn, o, ln2, gu, down, eps)
    logits, top = head_top(h[1:], norm_w, head, eps, k)
    return ck, cv, logits, top


def _attend_batch(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  scale: float) -> torch.Tensor:
    """`_attend` for S blocks at once: q (S, m, H, D), each part's keys and values (S, T, G, D)
    and seen (S, T) or per query (S, m, T) bool, block s attending its own. (S * m, H * D)."""
    s, m, nh, d = q.shape
    g = parts[0][0].shape[2]
    r = nh // g
    qg = q.view(s, m, g, r, d).permute(0, 2, 3, 1, 4).reshape(s, g, r * m, d)
    scores = [torch.matmul(qg, k.permute(0, 2, 3, 1)).masked_fill(
        ~(seen[:, None, None, :] if seen.dim() == 2 else seen.repeat(1, r, 1)[:, None]),
        float("-inf")) for k, _, seen in parts]  # (S, G, r*m, T) each
    probs = torch.softmax(torch.cat(scores, -1).float() * scale, dim=-1).to(q.dtype)
    out, a = None, 0
    for (k, v, _), sc in zip(parts, scores):
        o = torch.matmul(probs[..., a:a + sc.shape[-1]], v.transpose(1, 2))  # (S, G, r*m, D)
        out, a = o if out is None else out + o, a + sc.shape[-1]
    return out.view(s, g, r, m, d).permute(0, 3, 1, 2, 4).reshape(s * m, nh * d)


def draft_step_batch(feats: torch.Tensor, slots: torch.Tensor, done: torch.Tensor,
                     pos: torch.Tensor, known: torch.Tensor, ids: torch.Tensor,
                     cache_k: torch.Tensor, cache_v: torch.Tensor, embed: torch.Tensor,
                     fc_w: torch.Tensor, hn_w: torch.Tensor, kv: list, layers: list[LayerWeights],
                     inv_freq: torch.Tensor, norm_w: torch.Tensor, head: torch.Tensor,
                     eps: float, heads: int, kv_heads: int, head_dim: int, emb_scale: float,
                     k: int, kinds: tuple = ()) -> tuple[torch.Tensor, ...]:
    """`draft_step` for S contexts at once (the proposals of several speculating sequences in
    one step, `DFlashProposer.propose_batch`): `feats` is the whole feature store (contexts,
    rows, F), `slots`, `done`, `pos` (S,), `known` (S, >= T) and `ids` (S, m) each context's,
    `cache_k/v`
    (L, S, T, G, D) each context's cached keys. Returns the new context rows' keys and values
    (L, S, m, G, D), the logits (S, m - 1, V) and the top-k ids (S, m - 1, k)."""
    s, m = ids.shape
    dev = ids.device
    rows = torch.arange(m, device=dev)
    ctx_pos = done[:, None] + rows  # (S, m)
    picked = feats[slots[:, None], ctx_pos.clamp_max(feats.shape[1] - 1)]  # (S, m, F)
    ck, cv = context_kv_all(picked.reshape(s * m, -1), ctx_pos.reshape(-1), fc_w, hn_w, kv,
                            inv_freq, eps, kv_heads, head_dim)  # (L, S*m, G, D)
    ck, cv = ck.view(ck.shape[0], s, m, kv_heads, head_dim), cv.view(cv.shape[0], s, m,
                                                                     kv_heads, head_dim)
    keys = torch.arange(cache_k.shape[2], device=dev)[None, :]
    seen_cache = (keys < done[:, None]) & known[:, :cache_k.shape[2]]
    seen_ctx = (ctx_pos < pos[:, None]) & known.gather(1, ctx_pos.clamp_max(known.shape[1] - 1))
    seen_block = torch.ones(s, m, dtype=torch.bool, device=dev)
    h = F.embedding(ids.reshape(-1), embed)
    if emb_scale != 1.0:
        h = h * emb_scale
    cos, sin = rope_cos_sin(inv_freq, (pos[:, None] + rows).reshape(-1), h.dtype)
    scale = head_dim ** -0.5
    plain = (seen_cache, seen_ctx, seen_block)
    qpos = pos[:, None] + rows  # (S, m)
    cache_pos = torch.arange(cache_k.shape[2], device=dev).expand(s, -1)
    masks = {}
    for kind in kinds:
        if kind != (None, False) and kind not in masks:
            masks[kind] = (block_mask(kind, qpos, cache_pos, seen_cache),
                           block_mask(kind, qpos, ctx_pos, seen_ctx),
                           block_mask(kind, qpos, qpos))
    for i, (ln1, qkv, qkv_b, qn, kn, o, ln2, gu, down) in enumerate(layers):
        q, kb, vb = pre_attention(h, ln1, qkv, qkv_b, qn, kn, cos, sin, eps, heads, kv_heads,
                                  head_dim)
        sc, sx, sb = masks.get(kinds[i], plain) if kinds else plain
        attn = _attend_batch(q.view(s, m, heads, head_dim),
                             [(cache_k[i], cache_v[i], sc), (ck[i], cv[i], sx),
                              (kb.view(s, m, kv_heads, head_dim),
                               vb.view(s, m, kv_heads, head_dim), sb)], scale)
        h = post_attention(h, attn, o, ln2, gu, down, eps)
    logits, top = head_top(h.view(s, m, -1)[:, 1:].reshape(s * (m - 1), -1), norm_w, head,
                           eps, k)
    return ck, cv, logits.view(s, m - 1, -1), top.view(s, m - 1, -1)


def block_step(pos: int, m: int, device: torch.device,
               known: torch.Tensor | None = None) -> StepInfo:
    """An eager block of m rows at [pos, pos + m): every row sees every key < pos + m, the
    context's below pos only where `known` ((>= pos,) bool; None: all) holds
    (`DFlashProposer.gap`: rows that never came are False)."""
    mask = None if known is None else torch.cat([
        known[:pos], torch.ones(m, dtype=torch.bool, device=device)])[None, :].expand(m, -1)
    return StepInfo(torch.arange(pos, pos + m, device=device), pos + m, mask, pos)


def load_dflash(folder: Path, cfg: DFlashConfig, dtype: torch.dtype,
                device: torch.device | str, random_seed: int | None = None) -> DFlashDraft:
    """Read a DFlash checkpoint folder (its safetensors; shapes checked, names in errors), or
    with `random_seed` draw its tensors (`random:NAME`: only the config is read)."""
    from layersplit.shards.checkpoint_hf import HFCheckpoint

    ckpt = (HFCheckpoint(folder, config=cfg.model) if random_seed is None else
            RandomCheckpoint(folder, random_seed, config=cfg.model))
    if random_seed is None and ckpt.has("layers.0.self_attn.o_proj.bias"):
        raise CheckpointError(f"{folder}: layers.0.self_attn.o_proj.bias: a biased o_proj "
                              "(z-lab's attention_bias=true) is not implemented")
    shapes = dflash_tensor_shapes(cfg)
    tensors = ckpt.load(shapes, {k: k for k in shapes}, dtype, device)
    with torch.device("meta"):
        model = DFlashDraft(cfg)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.model)
    return model.to(device).eval().requires_grad_(False)


def dflash_config_dict(target: ModelConfig, *, layers: int, taps: list[int], block_size: int,
                       mask_token_id: int, intermediate_size: int | None = None) -> dict:
    """A `config.json` for a DFlash draft of `target` (same width and heads as the target)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "block_size": block_size, "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask_token_id},
        "torch_dtype": "bfloat16",
    }


def save_dflash(model: DFlashDraft, config: dict, folder: Path,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a draft in the published layout (an unfused model: q/k/v and gate/up apart)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    expected = set(dflash_tensor_shapes(model.cfg))
    if set(state) != expected:
        raise ValueError(f"cannot save a fused or foreign model: {sorted(set(state) ^ expected)}")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_config(folder, config)
    return folder


def write_config(folder: Path, config: dict) -> None:
    """A draft's config.json; its token tree (`spec_tree`) one path a line."""
    rest = json.dumps({k: v for k, v in config.items() if k != "spec_tree"}, indent=1)
    if config.get("spec_tree"):
        paths = ",\n  ".join(json.dumps(p) for p in config["spec_tree"])
        rest = rest[:-2] + f',\n "spec_tree": [\n  {paths}\n ]\n}}'
    (folder / "config.json").write_text(rest + "\n")


def write_random_dflash(target: ModelConfig, folder: Path, *, layers: int = 1,
                        taps: list[int] | None = None, block_size: int = 4,
                        mask_token_id: int = 0, seed: int = 0, std: float = 0.08) -> Path:
    """A seeded random-weight DFlash draft of `target` (for tests)."""
    taps = taps if taps is not None else default_target_layers(target.num_layers, layers)
    raw = dflash_config_dict(target, layers=layers, taps=taps, block_size=block_size,
                             mask_token_id=mask_token_id)
    cfg = read_dflash_config_dict(raw, Path(folder) / "config.json")
    model = DFlashDraft(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return save_dflash(model, raw, Path(folder), torch.float32)
