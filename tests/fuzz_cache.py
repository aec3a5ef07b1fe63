"""Prefix-cache files damaged every way we can think of, read back by a real 2-shard runtime.

`mutations(files)` yields (name, {file name: bytes}) cases made from a good entry directory:
truncation at every field boundary, bit flips in the header, the tokens, the checksums and the
payload, headers lying about offsets, dtypes, shapes and rows, and a file of another model (one
whose fingerprint is another's: all a reader can tell of a model).
`CacheFuzzer` runs each case on one running coordinator (the cache index is rebuilt from the
directory for every case) and sorts the outcome:

- `hit`: the damage did not matter (a timestamp digit, say); the output is the cold one;
- `miss`: less or nothing was restored, the output is the cold one, and a warning said why;
- `silent_miss`: as a miss, but nothing was logged (a defect);
- `wrong`: tokens or logits differ from the cold run (a defect);
- `crash`: an exception escaped, or the runtime went down (a defect).

The CI test runs a fixed subset (`tests/runtime/test_cache_fuzz.py`); `bench/cache_fuzz.py`
runs them all plus random bit flips and records the counts.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from layersplit.ipc.kv_file import read_layout
from layersplit.runtime.cache_ops import CacheManager
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

from tests.helpers import run_logged

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
Case = tuple[str, dict[str, bytes]]


class _Said(logging.Handler):
    """The runtime's warnings, and index scans that set files aside or found other models'."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        scan = re.search(r"\((\d+) other models, (\d+) bad\)", text)
        if record.levelno >= logging.WARNING or (scan and scan.group(1, 2) != ("0", "0")):
            self.messages.append(text)


def _header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8:8 + n])


def _with_header(data: bytes, doc: dict) -> bytes:
    """`data` with its header replaced by `doc`, padded to the old length when it fits (the data
    section stays where it was), else longer (the data section then moves: offsets lie)."""
    n = struct.unpack("<Q", data[:8])[0]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    size = max(n, len(raw))
    return struct.pack("<Q", size) + raw + b" " * (size - len(raw)) + data[8 + n:]


def _edit(data: bytes, change) -> bytes:
    n, doc = _header(data)
    change(doc)
    return _with_header(data, doc)


def _flip(data: bytes, at: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[at] ^= 1 << bit
    return bytes(b)


def boundaries(path: Path) -> list[tuple[str, int]]:
    """Every field boundary of an entry file: (what, byte offset)."""
    lay = read_layout(path)
    out = [("empty", 0), ("in the header length", 4), ("after the header length", 8),
           ("inside the header", 8 + lay.header_len // 2),
           ("before the header's last byte", 8 + lay.header_len - 1),
           ("after the header", lay.data_start)]
    for name, t in sorted(lay.tensors.items(), key=lambda kv: kv[1].begin):
        out += [(f"{name} first byte", lay.data_start + t.begin + 1),
                (f"{name} last byte", lay.data_start + t.end - 1)]
    return out


def mutations(files: dict[str, bytes], root: str, flips: int = 0,
              seed: int = 0) -> Iterator[Case]:
    """Damaged copies of the entry files `files` (name -> bytes). `root` names the file with no
    parent; each case damages one file (root or child) and keeps the others."""
    rng = random.Random(seed)
    for fname in sorted(files):
        data = files[fname]
        which = "root" if fname == root else "child"
        path_lay = _layout_of(data)
        n, doc = _header(data)

        def case(what: str, new: bytes) -> Case:
            return f"{which}: {what}", {**files, fname: new}

        # truncation at every field boundary
        for what, at in _boundaries_of(data):
            yield case(f"truncated at {what} ({at})", data[:at])
        # bit flips: header length, header JSON, tokens, checksums, payload, logits
        yield case("flip: header length high byte", _flip(data, 7, 7))
        yield case("flip: header length low bit", _flip(data, 0, 0))
        for key in ("fingerprint", "key", "kv_layout", "checksums", "start", "length", "parent"):
            raw = data[8:8 + n]
            i = raw.find(f'"{key}":"'.encode())
            if i >= 0:
                at = 8 + i + len(key) + 5  # a character inside the value
                yield case(f"flip: metadata {key}", _flip(data, at, 0))
        sums_at = data.find(b'"checksums":"')
        if sums_at >= 0:
            digit = data.find(b":", data.find(b'\\"', sums_at + 14)) + 3
            yield case("flip: a checksum digit", _flip(data, digit, 1))
        for name, t in sorted(path_lay.tensors.items()):
            start = path_lay.data_start + t.begin
            yield case(f"flip: {name} first byte", _flip(data, start, 3))
            yield case(f"flip: {name} last byte", _flip(data, start + t.nbytes - 1, 6))
        # headers that lie
        kv = sorted(k for k in path_lay.tensors if k.startswith("ls"))
        a, b = kv[0], kv[-1]

        def swap_offsets(d: dict, a: str = a, b: str = b) -> None:
            d[a]["data_offsets"], d[b]["data_offsets"] = d[b]["data_offsets"], d[a]["data_offsets"]

        def shift(d: dict, k: str, by: int) -> None:
            d[k]["data_offsets"] = [d[k]["data_offsets"][0] + by, d[k]["data_offsets"][1] + by]

        def meta(d: dict, key: str, value: str) -> None:
            d["__metadata__"][key] = value

        def add_rows(d: dict, k: str) -> None:
            shape = d[k]["shape"]
            shape[0] += 1
            per = d[k]["data_offsets"][1] - d[k]["data_offsets"][0]
            d[k]["data_offsets"][1] += per // max(shape[0] - 1, 1)

        first, last = path_lay.metadata["start"], path_lay.metadata["length"]
        lies = [
            ("offsets of two KV tensors swapped", swap_offsets),
            (f"{a} offsets shifted by 4 bytes", lambda d: shift(d, a, 4)),
            (f"{a} offsets shifted by -4 bytes", lambda d: shift(d, a, -4)),
            (f"{a} offset negative", lambda d: shift(d, a, -10**6)),
            (f"{b} offset past the end", lambda d: shift(d, b, 10**9)),
            ("tokens offset on a KV tensor", lambda d: d["tokens"].update(
                data_offsets=[d[a]["data_offsets"][0],
                              d[a]["data_offsets"][0] + d["tokens"]["data_offsets"][1]
                              - d["tokens"]["data_offsets"][0]])),
            (f"{a} dtype F16 (half the bytes)", lambda d: d[a].update(dtype="F16")),
            (f"{a} dtype I32 (same bytes)", lambda d: d[a].update(dtype="I32")),
            (f"{a} dtype F64 (unknown)", lambda d: d[a].update(dtype="F64")),
            ("prefill_logits dtype BF16", lambda d: d["prefill_logits"].update(dtype="BF16")),
            (f"{a} shape transposed", lambda d: d[a].update(shape=d[a]["shape"][::-1])),
            (f"{a} one row more", lambda d: add_rows(d, a)),
            ("tokens shape one longer", lambda d: d["tokens"].update(
                shape=[d["tokens"]["shape"][0] + 1])),
            ("start off by one", lambda d: meta(d, "start", str(int(first) + 1))),
            ("length off by one", lambda d: meta(d, "length", str(int(last) - 1))),
            ("start past length", lambda d: meta(d, "start", str(int(last) + 5))),
            ("length not a number", lambda d: meta(d, "length", "many")),
            ("parent names a missing entry", lambda d: meta(d, "parent", "0" * 32)),
            ("version 9", lambda d: meta(d, "version", "9")),
            ("format of another program", lambda d: meta(d, "format", "other")),
            ("kv_bytes negative", lambda d: meta(d, "kv_bytes", "-1")),
            ("checksums not JSON", lambda d: meta(d, "checksums", "{")),
            ("checksums of other names", lambda d: meta(d, "checksums", json.dumps(
                {k + "x": "0" * 16 for k in d if k != "__metadata__"}))),
            ("metadata a list", lambda d: d.update(__metadata__=[1, 2])),
            ("a tensor entry a string", lambda d: d.update({a: "nonsense"})),
            ("split of another run", lambda d: meta(d, "split", "[[0,6]]")),
        ]
        for what, change in lies:
            yield case(f"lies: {what}", _edit(data, change))
        if which == "child":
            root_key = _header(files[root])[1]["__metadata__"]["key"]
            root_len = _header(files[root])[1]["__metadata__"]["length"]
            if root_len != first:
                yield case("lies: parent names an entry that ends elsewhere",
                           _edit(data, lambda d: meta(d, "parent", root_key)))
        yield case("garbage of the same size", bytes(rng.randrange(256)
                                                      for _ in range(len(data))))
        yield case("zeros", b"\0" * len(data))
        for i in range(flips):
            at = rng.randrange(len(data))
            yield case(f"random flip {i} at byte {at}", _flip(data, at, rng.randrange(8)))
    # another model's entry under the name of ours: its fingerprint says whose it is
    other = _edit(files[root], lambda d: d["__metadata__"].update(fingerprint="f" * 32))
    yield "another model's file under our key", {**files, root: other}
    yield "another model's file beside ours", {**files, "0" * 32 + ".safetensors": other}


def _layout_of(data: bytes):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        return read_layout(Path(f.name))


def _boundaries_of(data: bytes) -> list[tuple[str, int]]:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        return boundaries(Path(f.name))


class CacheFuzzer:
    """Runs cases on one coordinator whose cache directory is `cache_dir`; `want` is the cold
    run (result, logits) of `prompt`."""

    def __init__(self, coord: Coordinator, cache_dir: Path, prompt: list[int], want) -> None:
        self.coord, self.dir, self.prompt, self.want = coord, cache_dir, prompt, want
        self.outcomes: Counter[str] = Counter()
        self.defects: list[str] = []
        self.handler = _Said()

    def run(self, name: str, files: dict[str, bytes]) -> str:
        c = self.coord
        for p in self.dir.iterdir():
            p.unlink() if p.is_file() else shutil.rmtree(p)
        for fname, data in files.items():
            (self.dir / fname).write_bytes(data)
        old = c.cache  # forget the RAM tier: every case restores from its files
        if old is not None:
            old._drop_ram([e.ram_id for e in old.index.entries.values() if e.ram_id is not None])
            next_id = old.index._next_ram_id
        self.handler.messages.clear()
        root = logging.getLogger()
        root.addHandler(self.handler)
        level = root.level
        root.setLevel(min(level, logging.INFO))
        try:
            c.cache = CacheManager(c)
            c.cache.index._next_ram_id = next_id  # snapshot ids stay unique on the shards
            got, logits = run_logged(c, self.prompt, GREEDY)
            c._finish_saves(30)
        except Exception as e:  # noqa: BLE001 - the outcome of the case
            return self._record(name, "crash", f"{type(e).__name__}: {e}")
        finally:
            root.removeHandler(self.handler)
            root.setLevel(level)
        if c.failed is not None:
            return self._record(name, "crash", f"the runtime went down: {c.failed}")
        want, want_logits = self.want
        if got.tokens != want.tokens or not np.array_equal(logits, want_logits):
            return self._record(name, "wrong", f"tokens {got.tokens} != {want.tokens}")
        if got.cached_tokens == len(self.prompt) and got.cache_tier == "disk":
            return self._record(name, "hit")
        if not self.handler.messages:
            return self._record(name, "silent_miss", f"{got.cache_tier} {got.cached_tokens}")
        return self._record(name, "miss")

    def _record(self, name: str, outcome: str, detail: str = "") -> str:
        self.outcomes[outcome] += 1
        if outcome in ("crash", "wrong", "silent_miss"):
            self.defects.append(f"{name}: {outcome} {detail}")
        return outcome
