"""The tiny test models can show a wrong answer: their output depends on every layer.

Restore and split tests compare outputs to catch KV rows or layers gone wrong; that only works
if a wrong layer changes the output. Here any one layer's KV rows (zeroed, or another layer's,
as a restore that mixed up layer indexes would leave them) or any one layer's weights (its residual
branches dropped) change the logits of the next steps by far more than rounding, and the greedy
tokens too."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import FAMILY_CONFIGS

GREEDY = SamplingParams(max_tokens=1)
STEPS = 12
CHUNK = 16


def _decode(ref: ReferenceEngine, prompt: list[int],
            corrupt: Callable[[], None] | None = None) -> tuple[list[int], np.ndarray]:
    """Prefill `prompt`, run `corrupt()`, then decode STEPS greedy tokens: (tokens, logits)."""
    out = None
    for a, b in prefill_chunks(prompt, 0, len(prompt), CHUNK, ref.eos_ids):
        out = ref.forward(prompt[a:b], a, GREEDY, 0, want_logits=True)
    if corrupt is not None:
        corrupt()
    tokens, logits = [], []
    tok, pos = out.token, len(prompt)
    for _ in range(STEPS):
        tokens.append(tok)
        out = ref.forward([tok], pos, GREEDY, 0, want_logits=True)
        logits.append(out.logits)
        tok, pos = out.token, pos + 1
    return tokens, np.stack(logits)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_layer_changes_the_output(tiny_models, family):
    ref = ReferenceEngine(tiny_models[family], prefill_chunk=CHUNK, max_context=128)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 2)
    n = len(prompt)
    tokens, logits = _decode(ref, prompt)
    assert len(set(tokens)) >= 4, f"greedy output is degenerate: {tokens}"
    scale = float(logits.std())
    kv, layers = ref.executor.kv, ref.executor.model.layers

    def zero_kv(i: int) -> None:
        kv.k[i, 0, :n] = 0
        kv.v[i, 0, :n] = 0

    def other_layers_kv(i: int) -> None:  # a layer index mixed up: the next layer's rows
        j = (i + 1) % len(layers)
        kv.k[i, 0, :n] = kv.k[j, 0, :n].clone()
        kv.v[i, 0, :n] = kv.v[j, 0, :n].clone()

    def check(what: str, got: tuple[list[int], np.ndarray]) -> None:
        got_tokens, got_logits = got
        moved = float(np.abs(got_logits - logits).max())
        assert moved > 0.2 * scale, f"{what}: logits moved by {moved:.2e} only"
        assert got_tokens != tokens, f"{what}: the greedy tokens did not change"

    for i in range(len(layers)):
        check(f"layer {i}'s KV zeroed", _decode(ref, prompt, lambda: zero_kv(i)))
        check(f"layer {i}'s KV from another layer",
              _decode(ref, prompt, lambda: other_layers_kv(i)))
        layer = layers[i]
        saved = {k: v.clone() for k, v in layer.state_dict().items()}
        with torch.no_grad():  # the layer adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            for name, w in layer.mlp.named_parameters():  # a dense MLP's or every expert's
                if "down_proj" in name or name.endswith(("w2", "w2.weight")):
                    w.zero_()
        check(f"layer {i}'s weights dropped", _decode(ref, prompt))
        layer.load_state_dict(saved)
    assert _decode(ref, prompt)[0] == tokens  # (every corruption was undone)
