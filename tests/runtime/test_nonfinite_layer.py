"""The layer walk names the first layer whose output went non-finite."""

from __future__ import annotations

import math
import shutil

import pytest
from layersplit.runtime.nonfinite_layer import first_nonfinite_layer
from safetensors.torch import load_file, save_file


@pytest.mark.parametrize("name,want", [
    ("model.layers.2.self_attn.o_proj.weight", "layer 2"),
    ("model.layers.5.mlp.up_proj.weight", "layer 5 (the last: or the final norm and LM head "
                                          "after it)"),
    (None, None),
])
def test_the_walk_names_the_first_bad_layer(tiny_llama, tmp_path, name, want):
    out = tmp_path / "m"
    shutil.copytree(tiny_llama, out)
    if name is not None:
        t = load_file(out / "model.safetensors")
        t[name][0, 0] = math.inf if "up_proj" in name else math.nan
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert first_nonfinite_layer(out, "float32", "cpu", [3, 4, 5, 6, 7]) == want
