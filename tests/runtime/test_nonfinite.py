"""A model whose logits go non-finite fails the request by name, greedy or sampled, plain or
speculated, in one or two shards: no token is drawn from NaN (real shard processes)."""

from __future__ import annotations

import math
import shutil

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.decoding import Decoding
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Progress
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


@pytest.fixture(scope="module")
def token_11_nan(tiny_models, tmp_path_factory):
    """The tiny Qwen2 (untied head) with only token 11's embedding NaN: a sequence goes
    non-finite at the step that feeds token 11, and no other."""
    out = tmp_path_factory.mktemp("nan11") / "qwen2"
    shutil.copytree(tiny_models["qwen2"], out)
    for f in out.glob("*.safetensors"):
        t = load_file(f)
        if "model.embed_tokens.weight" in t:
            t["model.embed_tokens.weight"][11] = math.nan
            save_file(t, str(f), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_a_decode_step_that_goes_nonfinite_fails_alone(token_11_nan, devices):
    """The prompt's steps are fine, the decode step fed token 11 fails by name, and the next
    sequence decodes again."""
    cfg = RuntimeConfig(model=str(token_11_nan), devices=devices, max_context=256, threads=1,
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


def test_one_nonfinite_sequence_fails_alone_in_a_batched_step(token_11_nan):
    """Two requests decode together; one is made to draw token 11 (logit_bias), so its next
    step goes non-finite: it fails by name, the other finishes with its own answer."""
    cfg = RuntimeConfig(model=str(token_11_nan), devices=("cpu", "cpu"), max_context=256,
                        threads=1, prefill_chunk=16)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Coordinator(cfg) as coord:
        alone = coord.generate([5, 6, 7, 8], greedy).tokens
        pa, pb = Progress(), Progress()
        a = coord.submit([5, 6, 7], greedy, pa, decoding=Decoding(logit_bias=((11, 100.0),)))
        b = coord.submit([5, 6, 7, 8], greedy, pb)
        while not (a.done and b.done):
            coord.batcher.run_once()
        assert isinstance(a.error, ShardFailure)
        assert "position 4 hold NaN or infinity" in str(a.error) and pa.generated == [11]
        assert b.error is None and pb.generated == alone


def test_nonfinite_logits_are_never_cached_for_a_later_exact_hit(token_11_nan):
    """A prompt whose rows go non-finite before its last chunk: its snapshot at the chunk
    boundary is not kept, so a later prompt ending there is computed (and fails by name)
    instead of drawing a token from stored NaN logits."""
    cfg = RuntimeConfig(model=str(token_11_nan), devices=("cpu",), max_context=256, threads=1,
                        prefill_chunk=16)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = [5, 6, 11] + [7] * 37
    with Coordinator(cfg) as coord:
        with pytest.raises(ShardFailure, match="NaN or infinity"):
            coord.generate(prompt, one)
        progress = Progress()
        with pytest.raises(ShardFailure, match="NaN or infinity"):
            list(coord.stream(prompt[:32], one, progress))
        assert progress.cached_tokens == 0 and progress.generated == []
