"""`layersplit cache ls|verify|prune DIR`: inspect and maintain a disk-tier directory offline."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from layersplit.ipc.kv_file import KVFileError, checksum, read_layout
from layersplit.runtime.prefix_cache import SUFFIX


@dataclasses.dataclass
class FileInfo:
    path: Path
    key: str
    parent: str | None
    start: int
    length: int
    size: int
    age_s: float
    fingerprint: str
    error: str | None = None


def scan(directory: str | Path) -> list[FileInfo]:
    out = []
    now = time.time()
    for p in sorted(Path(directory).glob(f"*{SUFFIX}")):
        st = p.stat()
        try:
            m = read_layout(p).metadata
            out.append(FileInfo(p, m["key"], m["parent"] or None, int(m["start"]),
                                int(m["length"]), st.st_size, now - st.st_mtime,
                                m["fingerprint"]))
        except (KVFileError, KeyError, ValueError) as e:
            out.append(FileInfo(p, p.stem, None, 0, 0, st.st_size, now - st.st_mtime, "",
                                str(e)))
    return out


def verify(path: Path) -> str | None:
    """None if every tensor's checksum matches, else what is wrong."""
    try:
        layout = read_layout(path)
        with open(path, "rb") as f:
            for name, t in layout.tensors.items():
                f.seek(layout.offset(name))
                if checksum(f.read(t.nbytes)) != layout.checksums[name]:
                    return f"tensor {name}: checksum mismatch"
    except (KVFileError, OSError) as e:
        return str(e)
    return None


def prune(directory: str | Path, max_bytes: int) -> list[Path]:
    """Delete least recently used entries, leaves first, until the directory fits."""
    infos = [i for i in scan(directory)]
    removed: list[Path] = []
    for bad in [i for i in infos if i.error]:
        bad.path.unlink(missing_ok=True)
        removed.append(bad.path)
    live = {i.key: i for i in infos if not i.error}
    total = sum(i.size for i in live.values())
    while total > max_bytes and live:
        parents = {i.parent for i in live.values() if i.parent}
        leaves = sorted((i for i in live.values() if i.key not in parents),
                        key=lambda i: -i.age_s)
        victim = leaves[0]
        victim.path.unlink(missing_ok=True)
        removed.append(victim.path)
        total -= victim.size
        del live[victim.key]
    return removed


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def age(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def _ensure_dir(directory: str | Path) -> Path:
    p = Path(directory)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such cache directory")
    return p


def cmd_ls(directory: str) -> int:
    infos = scan(_ensure_dir(directory))
    print(f"{'key':<34} {'parent':<14} {'rows':>13} {'size':>9} {'age':>5}  fingerprint")
    for i in infos:
        if i.error:
            print(f"{i.path.name:<34} BAD: {i.error}")
            continue
        print(f"{i.key:<34} {(i.parent or '-')[:12]:<14} {f'{i.start}:{i.length}':>13} "
              f"{human(i.size):>9} {age(i.age_s):>5}  {i.fingerprint[:12]}")
    total = sum(i.size for i in infos)
    print(f"{len(infos)} entries, {human(total)}")
    return 0


def cmd_verify(directory: str) -> int:
    bad = 0
    infos = scan(_ensure_dir(directory))
    keys = {i.key for i in infos if not i.error}
    for i in infos:
        why = i.error or verify(i.path)
        if why is None and i.parent and i.parent not in keys:
            why = f"parent {i.parent[:12]} is missing (restores stop at this entry's parent)"
            print(f"WARN {i.path.name}: {why}")
            continue
        if why is not None:
            bad += 1
            print(f"BAD  {i.path.name}: {why}")
    print(f"{len(infos)} entries checked, {bad} bad")
    return 1 if bad else 0


def cmd_prune(directory: str, max_gb: float) -> int:
    removed = prune(_ensure_dir(directory), int(max_gb * 2**30))
    for p in removed:
        print(f"removed {p.name}")
    left = sum(p.stat().st_size for p in Path(directory).glob(f"*{SUFFIX}"))
    print(f"{len(removed)} entries removed; {human(left)} left")
    return 0
