"""Where a profiled run's time went, from py-spy's raw (collapsed-stack) output: samples per
process, then, per process, by the innermost frames in our own code and by the package the
sampled frame is in.

    py-spy record --subprocesses --nonblocking --format raw -r 40 -o /tmp/run.txt -- \\
        python3 bench/startup.py --model random:qwen3.5-27b --devices cuda:0 --max-seqs 1
    python3 bench/pyspy_summary.py /tmp/run.txt --top 25

A line of py-spy's raw output is `frame;frame;... COUNT`, outermost first, each frame
`function (file:line)`, with `process PID:"command"` frames first under --subprocesses. At
`-r 40`, 40 samples are a second of a thread's time.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

OURS = ("shards/", "runtime/", "ipc/", "launch/", "draft/", "bench/")
PROCESS = re.compile(r'^process (\d+):"(.*)"$')


def parse(path: Path) -> list[tuple[str, str, list[str], int]]:
    """(pid, command, frames outermost first, samples) for each stack of the file."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        pid, command = "?", ""
        while frames and PROCESS.match(frames[0]):
            pid, command = PROCESS.match(frames[0]).groups()
            frames = frames[1:]
        stacks.append((pid, command, frames, int(count)))
    return stacks


def _file(frame: str) -> str:
    found = re.search(r"\(([^()]*):\d+\)$", frame)
    return found.group(1) if found else ""


def _name(frame: str) -> str:
    return frame.split(" (")[0]


def _relative(path: str) -> str:
    """A frame's file as py-spy shortens it (relative to its sys.path entry), or cut after a
    site-packages folder where it did not."""
    parts = re.split(r"(?:site|dist)-packages/", path, maxsplit=1)
    return parts[-1]


def ours_key(frames: list[str], depth: int = 3) -> str:
    """The innermost `depth` frames of our own code, outermost first (or `(none of ours)`)."""
    ours = [_name(f) for f in frames if _relative(_file(f)).startswith(OURS)]
    return " > ".join(ours[-depth:]) if ours else "(none of ours)"


def package_key(frames: list[str]) -> str:
    """The package of the sampled (innermost) frame: `triton`, `torch._inductor`, `fla`..."""
    if not frames:
        return "(idle)"
    path = _relative(_file(frames[-1]))
    if path.startswith(OURS):
        return "ours"
    if path.startswith("<") or "/" not in path:
        return path or "(native)"
    parts = path.split("/")
    return ".".join(parts[:2]) if parts[0] == "torch" and len(parts) > 2 else parts[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--rate", type=float, default=40.0, help="py-spy's -r (samples a second)")
    ap.add_argument("--depth", type=int, default=3, help="our frames per key")
    args = ap.parse_args()
    stacks = parse(args.raw)
    per_process: dict[str, int] = collections.Counter()
    commands = {}
    for pid, command, _, n in stacks:
        per_process[pid] += n
        commands[pid] = command
    for pid, total in per_process.most_common():
        print(f"\n## process {pid}: {total} samples ({total / args.rate:.1f} s) "
              f"{commands[pid][:150]}")
        ours: dict[str, int] = collections.Counter()
        packages: dict[str, int] = collections.Counter()
        for p, _, frames, n in stacks:
            if p == pid:
                ours[ours_key(frames, args.depth)] += n
                packages[package_key(frames)] += n
        print("by our innermost frames:")
        for key, n in ours.most_common(args.top):
            print(f"  {n / args.rate:7.2f} s  {key}")
        print("by the sampled frame's package:")
        for key, n in packages.most_common(min(args.top, 12)):
            print(f"  {n / args.rate:7.2f} s  {key}")


if __name__ == "__main__":
    main()
