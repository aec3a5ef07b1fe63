"""A model whose logits go non-finite fails the request by name, greedy or sampled, plain or
speculated, in one or two shards: no token is drawn from NaN (real shard processes)."""

from __future__ import annotations

import math
import shutil

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.errors import ShardFailure
from layersplit.shards.sampling import SamplingParams
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def poisoned(tiny_llama, tmp_path_factory):
    """The tiny Llama with one value of layer 4's down projection NaN: every position's logits
    are NaN once it runs."""
    out = tmp_path_factory.mktemp("nan") / "llama"
    shutil.copytree(tiny_llama, out)
    t = load_file(out / "model.safetensors")
    t["model.layers.4.mlp.down_proj.weight"][0, 0] = math.nan
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4, temperature=0.0),
                                    SamplingParams(max_tokens=4, temperature=0.8, seed=3)])
def test_nonfinite_logits_fail_the_request_by_name(poisoned, devices, params):
    cfg = RuntimeConfig(model=str(poisoned), devices=devices, max_context=256, threads=1,
                        prefill_chunk=16)
    with Coordinator(cfg) as coord:
        with pytest.raises(ShardFailure, match=r"NaN or infinity .*float32.*layers \d+:6"):
            coord.generate([5, 6, 7, 8], params)
        # the runtime stays up: the next request fails the same way, by name
        with pytest.raises(ShardFailure, match="nothing was sampled"):
            coord.generate([9, 10], params)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_a_decode_step_that_goes_nonfinite_fails_alone(tiny_models, tmp_path, devices):
    """Only token 11's embedding is NaN (untied head): the prompt's steps are fine, the decode
    step fed token 11 fails by name, and the next sequence decodes again."""
    out = tmp_path / "qwen2"
    shutil.copytree(tiny_models["qwen2"], out)
    for f in out.glob("*.safetensors"):
        t = load_file(f)
        if "model.embed_tokens.weight" in t:
            t["model.embed_tokens.weight"][11] = math.nan
            save_file(t, str(f), metadata={"format": "pt"})
    cfg = RuntimeConfig(model=str(out), devices=devices, max_context=256, threads=1,
                        prefill_chunk=16)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    with Coordinator(cfg) as coord:
        first = coord.forward([5, 6, 7], 0, greedy, 0)
        assert first.token is not None and first.token >= 0
        with pytest.raises(ShardFailure, match="position 4 hold NaN or infinity"):
            coord.forward([11], 3, greedy, 0)
        coord.batcher.sched.drop_held(0)
        again = coord.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(again.tokens) >= 1
