"""Random-weight HF folders of published model shapes, fewer layers, made by transformers itself:
what GPU parity checks run on where real weights are out of reach.

Every matrix keeps its published width (the kernels see the real shapes); the layer count is cut
so that transformers' float32 copy fits beside ours. Weights come from transformers' own
initialisation, and the final norm is scaled until the logits are not flat (a median top-1
probability of at least 0.3), so that top-1 agreement means something.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from layersplit.shards.random_weights import preset_path

log = logging.getLogger(__name__)

# family -> (configs/models preset, layers kept, config overrides). The windowed families get a
# 64-token window so that prompts of a few hundred tokens reach past it. Gemma 3's LM head is its
# own matrix here: tied to the embedding (scaled by sqrt(hidden) on the way in), random weights
# answer every prompt with one token repeated, where top-1 agreement cannot show a difference.
SHAPES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama": ("llama-8b-shape", 4, {}),
    "smollm2": ("smollm2-135m-shape", 30, {}),  # the default model's shape, whole (a Llama)
    "qwen3": ("qwen3-8b", 4, {}),
    "qwen3_5": ("qwen3.5-27b", 4, {}),  # 3 Gated DeltaNet layers, 1 gated attention layer
    "qwen3_moe": ("qwen3-30b-a3b", 4, {}),
    "gemma3": ("gemma3-12b", 6, {"sliding_window": 64,  # 5 local layers, 1 global
                                 "tie_word_embeddings": False}),
    "mistral": ("mistral-7b", 4, {"sliding_window": 64}),
    "deepseek_v3": ("deepseek-v2-lite-shape", 4, {}),  # MLA; 1 dense layer, 3 of experts
    "gpt_oss": ("gpt-oss-20b", 4, {}),  # 2 sliding (its own 128-token window), 2 full layers
    "glm4_moe": ("glm-4.5-air", 4, {}),  # the dense first layer, 3 of 128 experts + shared
}
MIN_TOP1_PROB = 0.3


def shape_config(family: str) -> dict[str, Any]:
    preset, layers, overrides = SHAPES[family]
    raw = json.loads((preset_path(preset) / "config.json").read_text())
    raw.update(num_hidden_layers=layers, **overrides)
    if "layer_types" in raw:  # (a published list of every layer's kind)
        raw["layer_types"] = raw["layer_types"][:layers]
    raw.setdefault("eos_token_id", None)
    return raw


def write_shape_checkpoint(out: str | Path, family: str, device: str = "cuda",
                           seed: int = 0, **overrides: Any) -> Path:
    """`family`'s reduced shape (`SHAPES`) as an HF folder in bfloat16, with the tiny test
    tokenizer (`shards.tiny`: its 320 ids are the first of the model's vocabulary).
    `overrides`: config fields changed further (CPU tests shrink the widths)."""
    import transformers
    from layersplit.shards.tiny import write_tokenizer

    out = Path(out)
    raw = {**shape_config(family), **overrides}
    made = json.dumps({"config": raw, "seed": seed}, sort_keys=True)
    stamp = out / "layersplit_shape.json"  # (what the folder was written from)
    if (out / "config.json").is_file() and stamp.is_file() and stamp.read_text() == made:
        return out
    if out.exists():  # (written from another config, by an older shape table, or cut short)
        other = [p.name for p in out.iterdir() if not (p.suffix in (".json", ".safetensors")
                                                        and p.is_file())]
        if other:
            raise FileExistsError(f"{out}: not a shape checkpoint's folder (it holds {other[:3]}); "
                                  "name an empty or new folder")
        log.info("%s: rewritten (its config differs from the shape's now)", out)
        shutil.rmtree(out)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items()
                                               if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    scale = _sharpen(model, cfg.vocab_size, device, seed)
    log.info("%s: %d layers of %s, final norm x%g", family, raw["num_hidden_layers"],
             SHAPES[family][0], scale)
    model.save_pretrained(out)
    write_tokenizer(out, raw.get("max_position_embeddings", 4096))
    stamp.write_text(made)  # (last: a folder cut short is written again)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _final_norm(model) -> torch.nn.Module:
    inner = getattr(model, "model", model)
    return inner.norm


def _sharpen(model, vocab: int, device: str, seed: int) -> float:
    """Scale the final norm (both its plain and its zero-centred forms: `w` and `1 + w`) by the
    smallest power of 2 (from 1/256 up) that makes the median top-1 probability reach
    MIN_TOP1_PROB: logits neither flat nor saturated (where one token takes all the
    probability, no difference shows)."""
    norm = _final_norm(model)
    w = norm.weight.data.clone()
    offset = 1.0 if w.float().abs().mean() < 0.5 else 0.0  # zero-centred norms start at 0
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 64), generator=g).to(device)
    scale = 1.0
    with torch.no_grad():
        for scale in (2.0 ** k for k in range(-8, 8)):
            norm.weight.data = (scale * (w.float() + offset) - offset).to(w.dtype)
            probs = model(input_ids=ids).logits.float().softmax(-1).amax(-1)
            if probs.median().item() >= MIN_TOP1_PROB:
                break
    return scale
