"""Deterministic keys of token prefixes: a chained hash over fixed-size blocks, seeded by a
fingerprint of everything that determines the KV rows (model config and weights, dtype, chat
template, prefill chunking). Same tokens, same key, in any process and after any restart."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

DIGEST = 16  # bytes: 128-bit keys
_EDGE = 1 << 20  # bytes hashed at each end of a weights file


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


def weights_identity(model: str | Path, random_seed: int = 0) -> str:
    """Cheap identity of a checkpoint's weights: names, sizes and the first and last MiB of
    each weights file (hashing whole 16 GB checkpoints at every start would take minutes). A
    `random:` shape's: its name, the seed and its folder's choice of values (`random.json`:
    chain weights, `shards.random_weights`), which all change the tensors."""
    s = str(model)
    if s.startswith("random:"):
        from layersplit.shards.random_weights import RANDOM_SPEC, random_folder

        spec = random_folder(s) / RANDOM_SPEC
        values = spec.read_text().strip() if spec.is_file() else "gaussian"
        return f"{s} seed={random_seed} {values}"
    p = Path(model)
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.suffix in (".safetensors", ".gguf", ".json"))
    h = hashlib.blake2b(digest_size=DIGEST)
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + struct.pack("<Q", size))
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            if size > 2 * _EDGE:
                fh.seek(size - _EDGE)
                h.update(fh.read(_EDGE))
    return h.hexdigest()


def model_fingerprint(config: dict, weights: str, dtype: str, chat_template: str | None,
                      chunk: int, turn_end_ids: Sequence[int], extra: str = "") -> str:
    doc = {"config": config, "weights": weights, "dtype": dtype, "chat_template": chat_template,
           "chunk": chunk, "turn_end_ids": sorted(turn_end_ids), "extra": extra}
    return _h(json.dumps(doc, sort_keys=True, default=str).encode()).hex()


def prefix_keys(fingerprint: str, tokens: Sequence[int], block: int,
                lengths: Sequence[int]) -> dict[int, str]:
    """Key of the prefix tokens[:P] for each P in `lengths`.

    Block i's hash is H(hash of block i-1, tokens of block i); a prefix that ends inside a
    block adds H(last full block hash, "tail", the remaining tokens)."""
    want = sorted(set(lengths))
    out: dict[int, str] = {}
    h = _h(bytes.fromhex(fingerprint))
    nblocks = max(want) // block if want else 0
    chain = [h]
    for i in range(nblocks):
        h = _h(h, struct.pack(f"<{block}i", *tokens[i * block:(i + 1) * block]))
        chain.append(h)
    for p in want:
        full = p // block
        if p % block == 0:
            out[p] = chain[full].hex()
        else:
            tail = tokens[full * block:p]
            out[p] = _h(chain[full], b"tail", struct.pack(f"<{len(tail)}i", *tail)).hex()
    return out
