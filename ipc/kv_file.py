"""The disk format of a prefix-cache entry: one safetensors file, written by several processes.

    [u64 header length N][N bytes of JSON header, space padded][tensor data]

The header maps each tensor name to {dtype, shape, data_offsets: [begin, end)} (offsets relative
to the data section) and carries `__metadata__` (string -> string): format, version, model
fingerprint, key, parent key, first and last row, KV layout, the split that wrote it, one xxh3-64
checksum per tensor, creation time. Any safetensors reader opens the file.

Tensors: `ls{shard}.L{layer}.k|v` (rows, kv_heads, head_dim) for the global layer index `layer`
written by shard `shard`; for a linear-attention layer of a hybrid model instead
`ls{shard}.L{layer}.conv` (conv_dim, kernel - 1) and `.state` (F32, value heads, key head dim, value
head dim), the layer's state after the entry's last row, whole in every entry; `tokens` (I32, every
token of the prefix, so the key can be checked); `prefill_logits` (F32, the logits of the prefix's
last row); `draft.feature_meta`, `draft.feature_data` when speculative decoding is on.

The header is written first with zeroed checksums of their final width, so filling them in
later never moves the data; each writer fills its own tensors at their offsets.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "layersplit-kv"
VERSION = "1"
ALIGN = 64
DTYPE_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32"}
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}
ZERO_SUM = "0" * 16
FEATURE_META = "draft.feature_meta"  # I32 [row width, tapped target layers...]
FEATURE_DATA = "draft.feature_data"  # (rows, width): tapped layers' rows side by side


class KVFileError(ValueError):
    """A cache file that cannot be used; the message says what is wrong with it."""


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass
class TensorSpec:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    begin: int = 0  # offset in the data section
    end: int = 0

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass
class Layout:
    """Where every tensor of one entry file lies, and its metadata."""

    tensors: dict[str, TensorSpec]
    metadata: dict[str, str]
    header_len: int = 0
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def offset(self, name: str) -> int:
        """Absolute file offset of a tensor's first byte."""
        return self.data_start + self.tensors[name].begin

    @property
    def file_size(self) -> int:
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)

    def header_bytes(self) -> bytes:
        meta = dict(self.metadata)
        meta["checksums"] = json.dumps(
            {n: self.checksums.get(n, ZERO_SUM) for n in sorted(self.tensors)},
            separators=(",", ":"))
        doc: dict[str, Any] = {"__metadata__": meta}
        for name, t in self.tensors.items():
            doc[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
        return json.dumps(doc, separators=(",", ":")).encode()


def plan(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> Layout:
    """Lay out tensors (name, dtype code, shape) back to back in the given order (safetensors
    allows no gaps; KV tensors first keeps them aligned, the data section starts 64-aligned)."""
    specs: dict[str, TensorSpec] = {}
    pos = 0
    for name, dtype, shape in tensors:
        t = TensorSpec(name, dtype, tuple(shape))
        t.begin, t.end = pos, pos + t.nbytes
        pos = t.end
        specs[name] = t
    meta = {"format": FORMAT, "version": VERSION, "created": f"{time.time():.3f}", **metadata}
    layout = Layout(specs, meta)
    raw = len(layout.header_bytes())
    # pad so the data section starts aligned; checksums keep their width when filled in
    layout.header_len = -(-(8 + raw) // ALIGN) * ALIGN - 8
    return layout


def write_header(f, layout: Layout) -> None:
    raw = layout.header_bytes()
    if len(raw) > layout.header_len:
        raise ValueError("header grew past its reserved size")
    f.seek(0)
    f.write(struct.pack("<Q", layout.header_len) + raw + b" " * (layout.header_len - len(raw)))


def read_layout(path: Path) -> Layout:
    """Parse and check the header of an entry file (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise KVFileError(f"{path.name}: truncated before its header")
            n = struct.unpack("<Q", head)[0]
            if n > 64 << 20:
                raise KVFileError(f"{path.name}: header length {n} is implausible")
            raw = f.read(n)
            size = f.seek(0, 2)
    except OSError as e:
        raise KVFileError(f"{path.name}: cannot read ({e})") from e
    if len(raw) < n:
        raise KVFileError(f"{path.name}: truncated inside its header")
    try:
        doc = json.loads(raw)
        meta = doc.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise KVFileError(f"{path.name}: not a layersplit KV file")
        if meta.get("version") != VERSION:
            raise KVFileError(f"{path.name}: format version {meta.get('version')!r}, this "
                              f"build reads {VERSION}")
        sums = json.loads(meta.pop("checksums"))
        tensors = {}
        for name, d in doc.items():
            t = TensorSpec(name, d["dtype"], tuple(int(x) for x in d["shape"]),
                           int(d["data_offsets"][0]), int(d["data_offsets"][1]))
            if t.dtype not in ITEMSIZE or t.end - t.begin != t.nbytes or t.begin < 0:
                raise KVFileError(f"{path.name}: tensor {name} has inconsistent size or "
                                  f"offsets ({t.dtype} {list(t.shape)} at {t.begin}:{t.end})")
            tensors[name] = t
    except KVFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise KVFileError(f"{path.name}: malformed header ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise KVFileError(f"{path.name}: malformed metadata")
    if not isinstance(sums, dict) or set(sums) != set(tensors) or \
            not all(isinstance(v, str) for v in sums.values()) or \
            not all(isinstance(v, str) for v in meta.values()):
        raise KVFileError(f"{path.name}: checksums or metadata malformed")
    layout = Layout(tensors, meta, n, sums)
    if size < layout.file_size:
        raise KVFileError(f"{path.name}: truncated ({size} of {layout.file_size} bytes)")
    return layout


def kv_name(shard: int, layer: int, kind: str) -> str:
    return f"ls{shard}.L{layer}.{kind}"


LAYER_KINDS = ("k", "v", "conv", "state")


def layer_tensors(layout: Layout) -> dict[tuple[int, str], str]:
    """(global layer, 'k'|'v'|'conv'|'state') -> tensor name, whatever split wrote the file."""
    out = {}
    for name in layout.tensors:
        if name.startswith("ls") and name.count(".") == 2:
            _, layer, kind = name.split(".")
            if layer.startswith("L") and layer[1:].isdigit() and kind in LAYER_KINDS:
                out[(int(layer[1:]), kind)] = name
    return out


def read_items(path: Path, items: list[dict]) -> list[bytes]:
    """The bytes of each item ({offset, nbytes, ...}) of a cache file, in order: what a shard
    that cannot reach the file is sent on restore (it checks them against the items'
    checksums, as it would bytes it read itself)."""
    out = []
    with open(path, "rb") as f:
        for it in items:
            data = os.pread(f.fileno(), it["nbytes"], it["offset"])
            if len(data) != it["nbytes"]:
                raise OSError(f"{path.name}: short read of {it['name']}")
            out.append(data)
    return out
