"""A sample's token masks applied to its logits in one Triton kernel, on a GPU.

Replaces the torch path of `shards.sampling.process_logits` for the two packed token masks a
sample may carry (`mask`, a grammar's; `rep_mask`, the repetition penalty's): `.float()`,
`.clone()`, per mask the unpack (shift, `& 1`, flatten, `bool`), the penalty's two `where`s,
`~` and `masked_fill` — about ten small kernels — become one launch that reads the logits in
their own dtype and each mask as packed bytes (bit t of byte t // 8: token t; an eighth of a
byte per token) and writes the float32 logits. Same math as the torch path on the same device:
a penalized positive logit is multiplied by the reciprocal of `rep` (what torch's CUDA division
by a Python scalar computes), a negative one by `rep`; a token whose grammar bit is clear gets
-inf.

The packed bytes reach the device through a pinned staging buffer, reused (`_Staging`), so the
copy does not wait on the host; one copy carries both masks of a sample.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per program


@triton.jit
def _token_mask(
    X, s_x,  # (rows, V) logits, any float dtype; row stride (token stride 1)
    OUT, s_out,  # (rows, V) float32; row stride; may be X itself (a float32 X, in place)
    ALLOWED,  # uint8 (>= ceil(V / 8),): the grammar's bits (HAS_ALLOWED)
    SEEN,  # uint8 (>= ceil(V / 8),): the repetition penalty's bits (HAS_SEEN)
    V, rep, inv_rep,  # inv_rep: the float32 reciprocal torch's CUDA x / rep multiplies by
    HAS_ALLOWED: tl.constexpr, HAS_SEEN: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < V
    x = tl.load(X + r * s_x + t, mask=ok, other=0.0).to(tl.float32)
    byte = t >> 3
    bit = t & 7
    if HAS_SEEN:
        seen = (tl.load(SEEN + byte, mask=ok, other=0).to(tl.int32) >> bit) & 1
        x = tl.where(seen != 0, tl.where(x > 0, x * inv_rep, x * rep), x)
    if HAS_ALLOWED:
        allowed = (tl.load(ALLOWED + byte, mask=ok, other=0).to(tl.int32) >> bit) & 1
        x = tl.where(allowed != 0, x, float("-inf"))
    tl.store(OUT + r * s_out + t, x, mask=ok)


def apply_token_masks(logits: torch.Tensor, allowed: torch.Tensor | None = None,
                      seen: torch.Tensor | None = None, rep: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` (rows, V) as float32, in `out` (a new tensor when None; `logits` itself, when
    float32, to work in place): tokens whose bit in `seen` is set penalized by `rep`, then those
    whose bit in `allowed` is clear set to -inf. `allowed` and `seen` are packed little-endian
    bitmasks, uint8 on the logits' device, of at least ceil(V / 8) bytes."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    need = (vocab + 7) // 8
    for name, bits in (("allowed", allowed), ("seen", seen)):
        if bits is not None and (bits.dtype != torch.uint8 or bits.dim() != 1
                                 or bits.numel() < need or bits.device != logits.device):
            raise ValueError(f"{name} must be uint8 ({need},) on {logits.device}, got "
                             f"{bits.dtype} {tuple(bits.shape)} on {bits.device}")
    if out is None:
        out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    elif (out.dtype != torch.float32 or out.shape != logits.shape or out.stride(-1) != 1
          or out.device != logits.device):
        raise ValueError(f"out must be float32 {tuple(logits.shape)} on {logits.device} with "
                         f"token stride 1, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if rows == 0 or vocab == 0:
        return out
    rep = float(rep)
    dummy = out  # (a pointer for an absent mask; never read)
    _token_mask[(rows, triton.cdiv(vocab, BLOCK))](
        logits, logits.stride(0), out, out.stride(0),
        dummy if allowed is None else allowed, dummy if seen is None else seen,
        vocab, rep, _reciprocal(rep, out.device),
        HAS_ALLOWED=allowed is not None, HAS_SEEN=seen is not None, BLOCK=BLOCK, num_warps=4)
    return out


@functools.lru_cache(maxsize=64)
def _reciprocal(rep: float, device: torch.device) -> float:
    """1 / rep as torch's division of a tensor by a Python scalar uses it on `device`: CUDA's
    `x / rep` is `x * r` for a float32 reciprocal r whose rounding (float32(1 / rep) or
    float32(1) / float32(rep)) is torch's to choose; 1 / rep computed by torch itself is r."""
    if device.type != "cuda":
        return float(np.float32(1.0) / np.float32(rep))
    return float((torch.ones(1, device=device) / rep).item())


class _Staging:
    """A device's pinned host buffer for packed masks, reused from one sample to the next.

    Reuse is safe because the host never writes the buffer while a copy out of it may still be
    in flight: each copy records `done` on the stream that runs it, and the next fill waits on
    it first (in practice the wait is free: a sample's token reaches the host, a device sync,
    before the next mask comes). The device side needs no such care: each copy goes to a new
    tensor from torch's caching allocator, whose reuse is ordered on the stream.
    """

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.done = torch.cuda.Event()  # (created on its first record; until then no wait)
        self.lock = threading.Lock()

    def to_device(self, parts: Sequence[bytes], device: torch.device) -> list[torch.Tensor]:
        """The byte strings `parts`, copied to `device` in one non-blocking copy."""
        n = sum(len(p) for p in parts)
        with self.lock:
            self.done.synchronize()
            if self.buf is None or self.buf.numel() < n:
                self.buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
            host = self.buf.numpy()
            at = 0
            for p in parts:
                host[at:at + len(p)] = np.frombuffer(p, dtype=np.uint8)
                at += len(p)
            dev = torch.empty(n, dtype=torch.uint8, device=device)
            dev.copy_(self.buf[:n], non_blocking=True)
            self.done.record(torch.cuda.current_stream(device))
        out, at = [], 0
        for p in parts:
            out.append(dev[at:at + len(p)])
            at += len(p)
        return out


_staging: dict[torch.device, _Staging] = {}
_staging_lock = threading.Lock()


def upload_masks(masks: Sequence[bytes | None], vocab: int,
                 device: torch.device) -> list[torch.Tensor | None]:
    """Each zlib-compressed packed token mask of `masks` (None: absent) inflated on the host
    and sent to the CUDA `device` as uint8 (ceil(vocab / 8),), all in one copy from pinned
    memory."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"upload_masks sends masks to a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    need = (vocab + 7) // 8
    raw = []
    for m in masks:
        if m is None:
            continue
        r = zlib.decompressobj().decompress(m, need)
        if len(r) < need:
            raise ValueError(f"a token mask holds {len(r) * 8} bits for a vocabulary of {vocab}")
        raw.append(r)
    if not raw:
        return [None] * len(masks)
    with _staging_lock:
        staging = _staging.setdefault(device, _Staging())
    sent = iter(staging.to_device(raw, device))
    return [None if m is None else next(sent) for m in masks]
