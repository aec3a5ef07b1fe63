"""The token-mask kernel (`shards.kernels.token_mask`) against the torch path it replaces
(`shards.sampling.process_logits`: `.float()`, unpack, `where`, `masked_fill`).

On a CUDA device (`python -m pytest -m gpu`): the kernel, and `process_logits` (which takes it
on a GPU) against the torch path on the same device (`LAYERSPLIT_FUSED_KERNELS=0`). On a CPU,
the kernel tests run through Triton's interpreter with `TRITON_INTERPRET=1`.

A grammar mask's output equals the torch path's exactly (a conversion to float32, and -inf);
the repetition penalty's within an ulp (the kernel multiplies by 1 / rep, as torch's CUDA
division by a scalar does; torch on a CPU divides).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from layersplit.shards import sampling
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.sampling import mask_bits, pack_bias, pack_mask, process_logits

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
CUDA = DEV != "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
VOCABS = [13, 1027, 3001, 49152]  # the first three: multiples neither of 8 nor of the block
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["random", "all", "one", "none"]
ULPS = {"rtol": 2.4e-7, "atol": 0.0}  # two float32 ulps
NEG_INF = float("-inf")


def _allowed(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.rand(vocab, generator=g) > 0.5
    a = torch.full((vocab,), kind == "all")
    if kind == "one":
        a[int(torch.randint(vocab, (1,), generator=g))] = True
    return a


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """The packed bytes of a (vocab,) bool mask, uint8 on DEV (what `upload_masks` sends)."""
    return torch.frombuffer(bytearray(zlib.decompress(pack_mask(allowed))),
                            dtype=torch.uint8).to(DEV)


def _logits(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (4 * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEV)


def _penalized(x: torch.Tensor, seen: torch.Tensor, rep: float) -> torch.Tensor:
    return torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_grammar_mask_equals_torch(vocab, dtype, kind):
    from layersplit.shards.kernels.token_mask import apply_token_masks

    g = torch.Generator().manual_seed(vocab)
    logits = _logits(3, vocab, dtype, g)
    allowed = _allowed(kind, vocab, g)
    got = apply_token_masks(logits, allowed=_packed(allowed))
    want = logits.float().masked_fill(~allowed.to(DEV), NEG_INF)
    assert got.dtype == torch.float32 and got.shape == (3, vocab)
    assert torch.equal(got, want)
    if kind == "one":  # a greedy constrained token: the one allowed
        assert got.argmax(-1).tolist() == [int(allowed.nonzero())] * 3


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rep", [1.1, 1.3, 1.7])
def test_repetition_penalty_then_grammar_mask(vocab, dtype, rep):
    """(1.1 and 1.7: 1 / rep rounds differently in double and in float32; torch's CUDA x / rep
    is x * (float32(1) / float32(rep)), which the kernel must match bit for bit on CUDA.)"""
    from layersplit.shards.kernels.token_mask import apply_token_masks

    g = torch.Generator().manual_seed(vocab + 1)
    logits = _logits(2, vocab, dtype, g)
    seen, allowed = _allowed("random", vocab, g), _allowed("random", vocab, g)
    got = apply_token_masks(logits, allowed=_packed(allowed), seen=_packed(seen), rep=rep)
    want = _penalized(logits.float(), seen.to(DEV), rep).masked_fill(~allowed.to(DEV), NEG_INF)
    torch.testing.assert_close(got, want, **ULPS)
    only_rep = apply_token_masks(logits, seen=_packed(seen), rep=rep)
    torch.testing.assert_close(only_rep, _penalized(logits.float(), seen.to(DEV), rep),
                               **ULPS)
    assert torch.isfinite(only_rep).all()
    if logits.is_cuda:  # (the interpreter's CPU division rounds otherwise: the tolerance above)
        assert torch.equal(only_rep, _penalized(logits.float(), seen.to(DEV), rep))


def test_strided_rows_and_in_place():
    from layersplit.shards.kernels.token_mask import apply_token_masks

    vocab = 3001
    g = torch.Generator().manual_seed(5)
    big = _logits(4, vocab + 5, torch.bfloat16, g)
    rows = big[1:3, :vocab]  # row stride vocab + 5
    allowed = _allowed("random", vocab, g)
    bits = _packed(allowed)
    want = rows.float().masked_fill(~allowed.to(DEV), NEG_INF)
    assert torch.equal(apply_token_masks(rows, allowed=bits), want)
    assert torch.equal(apply_token_masks(big[-1:, :vocab], allowed=bits),
                       big[-1:, :vocab].float().masked_fill(~allowed.to(DEV), NEG_INF))
    x = rows.float()
    assert apply_token_masks(x, allowed=bits, out=x) is x
    assert torch.equal(x, want)


def test_bad_arguments_are_named():
    from layersplit.shards.kernels.token_mask import apply_token_masks

    logits = torch.zeros(1, 20, device=DEV)
    with pytest.raises(ValueError, match="allowed must be uint8"):
        apply_token_masks(logits, allowed=torch.zeros(2, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="seen must be uint8"):
        apply_token_masks(logits, seen=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="rows, vocab"):
        apply_token_masks(logits[0])
    with pytest.raises(ValueError, match="out must be float32"):
        apply_token_masks(logits, out=torch.zeros(1, 20, dtype=torch.bfloat16, device=DEV))


def _samples(vocab: int, g: torch.Generator) -> list[dict]:
    mask = pack_mask(_allowed("random", vocab, g))
    rep = {"rep": 1.25, "rep_mask": pack_mask(_allowed("random", vocab, g))}
    bias = {"bias": pack_bias([0, 7, vocab - 1], [1.5, -2.0, NEG_INF])}
    return [{"mask": mask}, {**rep, "mask": mask}, {**rep, **bias, "mask": mask}, {**bias},
            {**rep}, {**bias, "mask": mask}, {"mask": pack_mask(_allowed("one", vocab, g))},
            {"mask": pack_mask(_allowed("none", vocab, g))}]


@pytest.mark.skipif(not CUDA, reason="process_logits takes the kernel on a CUDA device only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_process_logits_on_gpu_equals_the_torch_path(monkeypatch, dtype):
    vocab = 49155
    g = torch.Generator().manual_seed(7)
    for i, sample in enumerate(_samples(vocab, g) * 3):  # (the pinned buffer, reused)
        logits = _logits(2, vocab, dtype, g)
        got = process_logits(logits, sample)
        monkeypatch.setenv("LAYERSPLIT_FUSED_KERNELS", "0")
        want = process_logits(logits, sample)
        monkeypatch.delenv("LAYERSPLIT_FUSED_KERNELS")
        assert got.dtype == torch.float32 and got.data_ptr() != logits.data_ptr()
        torch.testing.assert_close(got, want, **ULPS, msg=f"sample {i}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.skipif(not CUDA, reason="process_logits takes the kernel on a CUDA device only")
def test_process_logits_on_gpu_runs_the_kernel():
    vocab = 1027
    g = torch.Generator().manual_seed(8)
    logits = _logits(1, vocab, torch.bfloat16, g)
    allowed = _allowed("random", vocab, g)
    process_logits(logits, {"mask": pack_mask(allowed)})  # (compiled before the profile)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        x = process_logits(logits, {"mask": pack_mask(allowed)})
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("_token_mask" in k for k in names), names
    assert torch.equal(x[0], logits[0].float().masked_fill(
        ~mask_bits(pack_mask(allowed), vocab, logits.device), NEG_INF))


@pytest.mark.skipif(not CUDA, reason="process_logits takes the kernel on a CUDA device only")
def test_a_failing_kernel_is_logged_and_the_torch_path_takes_over(monkeypatch, caplog):
    from layersplit.shards.kernels import token_mask

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(sampling, "_kernel_failed", False)
    monkeypatch.setattr(token_mask, "apply_token_masks", broken)
    vocab = 1027
    g = torch.Generator().manual_seed(9)
    logits = _logits(1, vocab, torch.bfloat16, g)
    allowed = _allowed("random", vocab, g)
    got = process_logits(logits, {"mask": pack_mask(allowed)})
    assert "token-mask kernel failed (RuntimeError: no compiler)" in caplog.text
    assert sampling._kernel_failed
    assert torch.equal(got, logits.float().masked_fill(~allowed.to(DEV), NEG_INF))


@pytest.mark.skipif(not CUDA, reason="masks go to a CUDA device")
def test_upload_masks_names_a_short_mask():
    from layersplit.shards.kernels.token_mask import upload_masks

    with pytest.raises(ValueError, match="holds 8 bits for a vocabulary of 20"):
        upload_masks([pack_mask(torch.ones(8, dtype=torch.bool))], 20, torch.device(DEV))
    seen, none, allowed = upload_masks([pack_mask(torch.ones(20, dtype=torch.bool)), None,
                                        pack_mask(torch.zeros(20, dtype=torch.bool))], 20,
                                       torch.device(DEV))
    assert none is None and seen.tolist() == [255, 255, 15] and allowed.tolist() == [0, 0, 0]
