"""A fast reader of the GGUF header (key/values and tensor table).

`gguf.GGUFReader` builds a numpy view per array element, which takes ~6 s for the 100K strings of
a BPE vocabulary; this reader parses the same header in well under a second. Tensor bytes stay in
the file and are memory-mapped on demand; dequantization uses the `gguf` package.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from layersplit.shards.errors import CheckpointError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    type: int
    offset: int  # absolute file offset of the data
    nbytes: int


# headers parsed in this process, shared while something holds them (a GGUFFile the coordinator
# reads for the dtype, the shape and the tokenizer): held weakly, so a shard that has loaded its
# layers and dropped its checkpoint keeps neither the file's map nor its vocabulary
_OPENED: weakref.WeakValueDictionary[tuple, GGUFHeader] = weakref.WeakValueDictionary()
_OPENED_LOCK = threading.Lock()


def read_header(path: Path) -> GGUFHeader:
    """`path`'s header, parsed once while some reader of this process holds it and the file
    stays the same one (device, inode, size, modification and change times)."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from e
    key = (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
           st.st_ctime_ns)
    with _OPENED_LOCK:
        header = _OPENED.get(key)
    if header is None:
        header = GGUFHeader(path)  # (outside the lock: two threads may parse it both)
        with _OPENED_LOCK:
            header = _OPENED.setdefault(key, header)
    return header


class GGUFHeader:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot open ({e})") from e
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed or truncated GGUF header ({e})") from e

    # -- primitive readers -------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _strings(self, count: int) -> list[str]:
        """An array of `count` strings (a vocabulary's 50-150K tokens and merges: one tight
        loop, no call per string)."""
        mm, pos, size = self._mm, self._pos, len(self._mm)
        unpack = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            start = pos + 8
            pos = start + unpack(mm, pos)[0]
            if pos > size:
                raise ValueError("string runs past the end of the file")
            append(mm[start:pos].decode("utf-8"))
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self._pos + count * dt.itemsize
                if end > len(self._buf):
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self._buf[self._pos:end], dtype=dt).tolist()
                self._pos = end
                return arr
            if etype == STRING:
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    # -- layout --------------------------------------------------------------------------------
    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self._buf[:4]) != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ndim = self._unpack("<I")
            shape = tuple(self._unpack("<Q") for _ in range(ndim))
            infos.append((name, shape, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, off in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                block, type_size = 1, 0  # unknown type: reported when the tensor is read
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            nbytes = n // block * type_size
            start = data_start + off
            if start + nbytes > len(self._buf):
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)"
                )
            self.tensors[name] = TensorInfo(name, shape, ttype, start, nbytes)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The stored bytes of a tensor as uint8 rows (the layout `gguf.quants.dequantize` takes)
        or, for plain float types, as the typed array."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qt = GGMLQuantizationType(info.type)
        data = np.frombuffer(self._buf[info.offset:info.offset + info.nbytes], dtype=np.uint8)
        rows = list(reversed(info.shape))
        if qt == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(rows)
        if qt == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(rows)
        block, type_size = GGML_QUANT_SIZES[qt]
        return data.reshape(*rows[:-1], rows[-1] // block * type_size)
