"""Token sampling: greedy, temperature, top-k, top-p, seeded.

Sampling is stateless: the random draw for the token at position p is argmax(probs / E), E the
exponential noise of each token for the key mix(seed, p), a pure function of (key, token)
(`exponential_noise`: counter-based, SplitMix64; its integers the same on every device, its
float64 logarithm at most a last bit apart between a CPU and a GPU). The same request therefore
samples the same tokens whether or not its prefix was restored from a cache, whichever process
samples, and however the steps were batched; the noise of many rows, or of a few tokens only
(a draft's coupled draws), is one computation.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

import torch
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.sampling_params import (  # noqa: F401 - importable from here
    SamplingParams,
    is_greedy,
    pack_bias,
    pack_mask,
)

log = logging.getLogger(__name__)
_MASK64 = (1 << 64) - 1
_kernel_failed = False  # the token-mask kernel failed once (`process_logits`)
_noise_kernel_failed = False  # the noise kernel failed once (`vocab_noise`)


def mix_seed(seed: int, position: int, stream: int = 0) -> int:
    """splitmix64 of (seed, position, stream): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int,
                   top_p: float) -> torch.Tensor:
    """Probabilities (rows, V) after temperature, top-k and top-p; float32."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        drop = cum - sp > top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 that has its bits (torch's integers are signed)."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` shifts the sign in)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _keys_on(keys: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """The keys as int64 on `device`; to a GPU from pinned memory without waiting for its
    stream (a pageable copy would wait for the step's kernels: the sampling shard's host
    queues its sampling behind them)."""
    t = torch.tensor([_signed(k) for k in keys], dtype=torch.int64)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def counter_uniform(keys: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (row's key, id): `ids` (rows, k) int64, row i's
    drawn under `keys[i]` (`mix_seed`). SplitMix64: the id-th output of the stream seeded by
    the key, its top 52 bits; int64 arithmetic wraps alike on every device."""
    if ids.dim() != 2 or ids.shape[0] != len(keys):
        raise ValueError(f"counter_uniform: ids {tuple(ids.shape)} are not one row per key "
                         f"({len(keys)})")
    key = _keys_on(keys, ids.device)
    z = key[:, None] + (ids.to(torch.int64) + 1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    z = z ^ _shr(z, 31)
    return _unit(z)


def _unit(z: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) as a uniform in (0, 1), float64: the top 52 bits n, (n + 0.5) /
    2**52, exact, so u is in [2**-53, 1 - 2**-53] (with 53 bits n + 0.5 rounds to 2**53 at the
    top: u = 1, noise -0.0, and 0 / -0.0 a NaN that argmax takes)."""
    return (_shr(z, 12).double() + 0.5) * 2.0 ** -52


def exponential_noise(keys: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """Exponential(1) noise, float32, of each (row's key, id) (`counter_uniform`): argmax of
    probs / noise over a row draws from probs (the exponential race)."""
    return (-torch.log(counter_uniform(keys, ids))).float()


def vocab_noise(keys: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """`exponential_noise` of every token of the vocabulary, (len(keys), vocab); on a GPU one
    Triton kernel (`shards.kernels.noise`), the torch ops where it does not run."""
    global _noise_kernel_failed
    if not _noise_kernel_failed and fused_kernels_available(device) and \
            torch.device(device).type == "cuda":
        try:
            from layersplit.shards.kernels import noise

            return noise.vocab_noise(_keys_on(keys, device), vocab)
        except Exception as e:  # noqa: BLE001 - the torch ops give the same noise
            log.warning("the sampling noise kernel failed (%s: %s); using the torch ops",
                        type(e).__name__, e)
            _noise_kernel_failed = True
    ids = torch.arange(vocab, device=device).expand(len(keys), vocab)
    return exponential_noise(keys, ids)


def sample_rows(
    logits: torch.Tensor,  # (rows, V)
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    positions: Sequence[int],
) -> list[int]:
    """One token per row; row i samples the token that goes to `positions[i]`."""
    return sample_tokens(logits, temperature, top_k, top_p, seed, positions).tolist()


def sample_tokens(
    logits: torch.Tensor,  # (rows, V)
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    positions: Sequence[int],
) -> torch.Tensor:
    """`sample_rows` left on the logits' device: (rows,) int64, drawn without waiting for it."""
    if is_greedy(temperature, top_k):
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    noise = vocab_noise([mix_seed(seed, p) for p in positions], probs.shape[-1], probs.device)
    return torch.argmax(probs / noise, dim=-1)


# ---- logits processing and logprobs (the `sample` dict's optional fields) -----------------------
# A segment's `sample` may carry, besides SamplingParams.wire():
#   "lp":   int >= 0: return the logprob of each emitted token and its top `lp` alternatives
#   "bias": bytes (`pack_bias`: int32 token ids, then their float32 values): added to those
#           logits (logit_bias, presence/frequency penalties, min_tokens' -inf on the stop
#           tokens; the coordinator sums them per step)
#   "rep":  float > 0 and "rep_mask": a token mask (as "mask"): the repetition penalty over
#           those tokens (a positive logit divided by rep, a negative one multiplied)
#   "mask": bytes: zlib of a little-endian bitmask of the vocabulary (bit t set: t allowed), a
#           grammar's (`runtime.grammar`)
#   "late_mask": true: the mask comes apart, after the step (a `mask` message to the last shard,
#           which holds the step's sampling until it has it): the coordinator computes it while
#           the step runs
# (bytes, not lists: a step's header stays small whatever the vocabulary or the penalties)
# They apply in that order, before temperature; a segment with any of them is not speculated.
PROCESSOR_KEYS = ("bias", "rep", "mask", "late_mask")


def check_processors(sample: dict, vocab: int) -> str | None:
    """What is wrong with a `sample` dict's optional fields, or None."""
    lp = sample.get("lp")
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= vocab):
        return f"lp={lp!r} must be an integer in 0..{vocab}"
    bias = sample.get("bias")
    if bias is not None:
        if not isinstance(bias, bytes) or len(bias) % 8:
            return "bias must be bytes: int32 token ids, then as many float32 values"
        ids, _ = unpack_bias(bias)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            return "bias names a token id outside the vocabulary"
    rep = sample.get("rep")
    if rep is not None:
        if not isinstance(rep, (int, float)) or isinstance(rep, bool) or not rep > 0:
            return f"rep={rep!r} must be a number > 0"
        bad = check_mask(sample.get("rep_mask"), vocab, "rep_mask")
        if bad is not None:
            return bad
    late = sample.get("late_mask")
    if late is not None and (late is not True or sample.get("mask") is not None):
        return f"late_mask={late!r} must be true, and the sample then holds no mask"
    if sample.get("mask") is not None:
        return check_mask(sample["mask"], vocab, "mask")
    return None


def check_mask(mask: object, vocab: int, name: str) -> str | None:
    """What is wrong with a packed token mask (`pack_mask`) of `vocab` tokens, or None."""
    if not isinstance(mask, bytes):
        return f"{name} must be bytes (a zlib-compressed token bitmask)"
    need = (vocab + 7) // 8
    try:
        d = zlib.decompressobj()
        raw = d.decompress(mask, need + 64)  # (never more than a mask's worth inflated)
    except zlib.error as e:
        return f"{name} is not zlib data ({e})"
    if len(raw) < need:
        return f"{name} holds {len(raw) * 8} bits for a vocabulary of {vocab}"
    return None


def unpack_bias(b: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(b) // 8
    if not n:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    raw = bytearray(b)
    return (torch.frombuffer(raw, dtype=torch.int32, count=n).long(),
            torch.frombuffer(raw, dtype=torch.float32, count=n, offset=4 * n))


def has_processors(sample: dict | None) -> bool:
    return sample is not None and any(sample.get(k) is not None for k in PROCESSOR_KEYS)


def mask_bits(mask: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """The allowed tokens (vocab,) bool of a zlib-compressed little-endian token bitmask
    (unpacked on `device`: a GPU is sent the packed bytes, an eighth of the mask)."""
    raw = torch.frombuffer(bytearray(zlib.decompressobj().decompress(mask, (vocab + 7) // 8)),
                           dtype=torch.uint8).to(device)
    bits = (raw[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1
    return bits.flatten()[:vocab].bool()


def process_logits(logits: torch.Tensor, sample: dict) -> torch.Tensor:
    """Logits (rows, V) after the sample's repetition penalty, bias and grammar mask (a new
    float32 tensor; the same logits when there are none). On a GPU the masks apply in a Triton
    kernel (`_process_with_kernel`; should it fail, logged, the torch code below from then on),
    elsewhere as below."""
    global _kernel_failed
    if not has_processors(sample):
        return logits
    if logits.is_cuda and not _kernel_failed and fused_kernels_available(logits.device):
        try:
            return _process_with_kernel(logits, sample)
        except (torch.cuda.OutOfMemoryError, ValueError):  # (a bad mask: the torch path's too)
            raise
        except Exception as e:  # noqa: BLE001 - logged; the torch path from then on
            log.warning("the Triton token-mask kernel failed (%s: %s); applying token masks "
                        "with torch", type(e).__name__, e)
            _kernel_failed = True
    x = logits.float().clone()
    rep = sample.get("rep")
    if rep is not None:
        seen = mask_bits(sample["rep_mask"], x.shape[-1], x.device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    _add_bias(x, sample.get("bias"))
    mask = sample.get("mask")
    if mask is not None:
        x = x.masked_fill(~mask_bits(mask, x.shape[-1], x.device), float("-inf"))
    return x


def _add_bias(x: torch.Tensor, bias: bytes | None) -> None:
    if bias:
        ids, vals = unpack_bias(bias)
        x.index_add_(1, ids.to(x.device), vals.to(x.device).expand(x.shape[0], -1).contiguous())


def _process_with_kernel(logits: torch.Tensor, sample: dict) -> torch.Tensor:
    """`process_logits` on a GPU: the packed masks go to the device in one copy from pinned
    memory, and one kernel (`shards.kernels.token_mask`) converts the logits to float32 and
    applies them; with a bias, which goes between the penalty and the grammar mask, two: the
    penalty's, then the bias (torch), then the grammar's in place. (Triton is imported here,
    on first use: never where the kernels do not run.)"""
    from layersplit.shards.kernels.token_mask import apply_token_masks, upload_masks

    rep, bias = sample.get("rep"), sample.get("bias")
    seen, allowed = upload_masks([None if rep is None else sample["rep_mask"], sample.get("mask")],
                                 logits.shape[-1], logits.device)
    rep = 1.0 if rep is None else rep
    if not bias:
        return apply_token_masks(logits, allowed=allowed, seen=seen, rep=rep)
    x = apply_token_masks(logits, seen=seen, rep=rep)
    _add_bias(x, bias)
    return x if allowed is None else apply_token_masks(x, allowed=allowed, out=x)


def logprob_entries(logits: torch.Tensor, tokens: Sequence[int], temperature: float,
                    k: int) -> list[list]:
    """For row i of `logits` (rows, V) and the token `tokens[i]` drawn from it: [token, its
    logprob, [top k ids], [their logprobs]], of the distribution after temperature (the
    logits as they are when greedy: temperature 0 has no distribution of its own); before
    top-k / top-p truncation, after the sample's processors."""
    x = logits.float()
    if temperature > 0:
        x = x / temperature
    lp = torch.log_softmax(x, dim=-1)
    idx = torch.tensor(list(tokens), device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    top_v, top_i = (torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [[int(t), float(c), ti, tv] for t, c, ti, tv in zip(tokens, chosen, top_i, top_v)]
