"""`layersplit generate --model DIR` on a tiny checkpoint of each newer family saved by
transformers' own classes (`save_pretrained`: its tensor names, its config.json), Qwen3-MoE
split over 2 shards, gives transformers' own greedy tokens. (Splits, restores and speculation of
a MoE model: tests/runtime/test_moe_runtime.py.) The command runs in this process
(`tests.helpers.run_cli`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from layersplit.shards.tiny import FAMILY_CONFIGS, write_tiny_checkpoint

from tests.helpers import run_cli, shard_children

transformers = pytest.importorskip("transformers")

# family -> (weight std, norm weight std: greedy output varies with them; shards)
FAMILIES = {"qwen3_moe": (0.2, 0.1, 2), "mixtral": (0.2, 0.1, 1), "qwen2_moe": (0.2, 0.1, 1),
            "gemma3_text": (0.05, 0.3, 1), "llama-yarn-rope": (0.2, 0.1, 1),
            "deepseek_v3": (0.2, 0.1, 1), "glm4_moe": (0.2, 1.0, 2), "gpt_oss": (0.2, 0.1, 1)}
PROMPT = "the quick brown fox jumps"
NEW = 10


def _saved_by_transformers(root, family: str, std: float, norm_std: float):
    """A random model of `family`'s tiny config built by transformers, saved by it, with the
    tiny tokenizer next to it."""
    raw = {k: v for k, v in FAMILY_CONFIGS[family].items() if k != "architectures"}
    model_type = raw.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **raw, num_hidden_layers=4,
                                            vocab_size=320, eos_token_id=2, pad_token_id=0,
                                            bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # weights large enough that greedy output varies
        for name, p in model.named_parameters():
            p.normal_(0.0, norm_std if "norm" in name else std)
    out = root / family
    model.save_pretrained(out)
    tok = write_tiny_checkpoint(root / "tok", "llama", num_layers=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    return out, model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_cli_gives_transformers_greedy_tokens(tmp_path, family):
    std, norm_std, shards = FAMILIES[family]
    path, hf = _saved_by_transformers(tmp_path, family, std, norm_std)
    from layersplit.runtime.tokenizer import TextTokenizer

    ids = TextTokenizer.from_path(path).encode(PROMPT)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    assert len(set(want)) > 2  # not one token repeated
    r = run_cli("generate", PROMPT, "--model", str(path), "--devices", ",".join(["cpu"] * shards),
                "--threads", "1", "--max-tokens", str(NEW), "--ignore-eos", "--json",
                "--draft", "none")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["tokens"] == want
    assert shard_children() == []
