"""Prefix cache: TTFT of a cold prefill vs a RAM-tier restore vs a disk restore after a restart
(page cache cold and warm), restore GB/s next to a raw sequential read of the same files, and
save GB/s (file bytes over the wall time some save was in flight, from the RAM snapshot to the
renamed file) next to a raw write + fsync of as many bytes into the same directory, taken right
after the saves (the faster of two); both ratios are in the `--json` rows (`save_vs_raw_write`,
`restore_vs_raw_read`, page cache dropped before both reads), all in one run.

    python bench/prefix_cache.py --model default --devices cpu,cpu --lengths 1024,4096,8000
    python bench/prefix_cache.py --model random:qwen3-8b --devices cuda:0,cuda:1 \
        --lengths 8192,32768
    python bench/prefix_cache.py --model random:qwen3.5-27b --devices cuda:0,cuda:1 \
        --restore-devices cuda:0 --lengths 32768 --check-tokens 16     # saved on 2, restored on 1

Each length uses a prompt of that many tokens, repeated exactly (an exact hit restores every
row and samples from the stored logits: its TTFT is the restore itself). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path]) -> tuple[int, float]:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def raw_write(directory: Path, nbytes: int) -> float:
    p = directory / "raw-write.bin"
    chunk = os.urandom(1 << 20) * 64
    t0 = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        p.unlink(missing_ok=True)  # (not left in the cache directory after an error either)
    return nbytes / dt


def ttft(coord: Coordinator, prompt: list[int]) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    r = coord.generate(prompt, ONE)
    return time.perf_counter() - t0, r.cache_tier, r.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=0.0,
                    help="each shard's KV pool (default: max_seqs x the length's context)")
    ap.add_argument("--dir", default=None, help="cache directory (default: a temporary one)")
    ap.add_argument("--restore-devices", default=None,
                    help="the restarts run on these devices (a cross-split restore)")
    ap.add_argument("--check-tokens", type=int, default=0,
                    help="greedy tokens after each restore, compared with the saving run's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(args.dir or tempfile.mkdtemp(prefix="lsbench-"))
    rows = []
    for n in lengths:
        d = root / f"kv{n}"
        shutil.rmtree(d, ignore_errors=True)
        cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                            max_context=n + 64, prefill_chunk=args.prefill_chunk,
                            kv_cache_dir=str(d), cache_ram_gb=64, kv_cache_gb=args.kv_cache_gb)
        prompt = [(i * 7919) % 30000 + 10 for i in range(n)]
        row: dict = {"tokens": n}
        restore_cfg = cfg if not args.restore_devices else replace(
            cfg, devices=tuple(args.restore_devices.split(",")))
        greedy = SamplingParams(max_tokens=args.check_tokens, ignore_eos=True)
        with Coordinator(cfg) as c:
            warm = [(i * 104729) % 30000 + 10 for i in range(min(n, 2 * args.prefill_chunk))]
            c.generate(warm, ONE, use_cache=False)  # warm up kernels and allocators
            row["cold_s"], _, _ = ttft(c, prompt)
            c._finish_saves(600)
            row["ram_s"], tier, cached = ttft(c, prompt)
            assert tier == "ram" and cached == n, (tier, cached)
            st = c.cache.stats
            # wall time with a save in flight (a delta entry's save overlaps its parent's)
            row["save_GBps"] = st.bytes_written / max(st.save_wall_s, 1e-9) / 1e9
            row["file_bytes"] = st.bytes_written
            # of that, the time the writers waited for the snapshots' host copies (the RAM tier's
            # device -> host copy); the rest is the file's write, checksums, fsync and rename
            # (one entry a length: a prompt that is a multiple of the chunk)
            row["save_copy_wait_s"] = st.save_copy_wait_s
            # (None where the waits, summed over overlapping saves, reach the wall time: the
            # difference would mean nothing)
            after = st.save_wall_s - st.save_copy_wait_s
            row["save_after_copy_GBps"] = (st.bytes_written / after / 1e9
                                           if after > 0.1 * st.save_wall_s else None)
            # the baseline at once: the same bytes written and fsynced into the same directory,
            # twice (the faster counts: a disk still busy after the saves would flatter them)
            row["raw_write_runs_GBps"] = [raw_write(d, row["file_bytes"]) / 1e9 for _ in range(2)]
            row["raw_write_GBps"] = max(row["raw_write_runs_GBps"])
            est_prefill_s = c.cache.prefill_seconds(n, n)
            if args.check_tokens:
                ref = c.generate(prompt, greedy, use_cache=False).tokens  # computed, not restored
        files = sorted(d.glob("*.safetensors"))
        for label in ("disk_cold", "disk_warm"):
            if label == "disk_cold":
                drop_page_cache(files)
            with Coordinator(restore_cfg) as c:
                row[f"{label}_s"], tier, cached = ttft(c, prompt)
                assert tier == "disk" and cached == n, (tier, cached)
                row[f"{label}_GBps"] = c.cache.stats.bytes_restored_disk / max(
                    c.cache.stats.disk_read_s, 1e-9) / 1e9
                row[f"{label}_rate_Bps"] = c.cache.disk_rate
                if args.check_tokens:
                    got = c.generate(prompt, greedy).tokens
                    row[f"{label}_same_tokens"] = got == ref
                    if got != ref:
                        print(f"{n} tokens, {label}: greedy tokens differ from the saving "
                              f"run's:\n  saved    {ref}\n  restored {got}")
        drop_page_cache(files)
        nbytes, dt = raw_read(files)
        row["raw_read_cold_GBps"] = nbytes / dt / 1e9
        nbytes, dt = raw_read(files)
        row["raw_read_warm_GBps"] = nbytes / dt / 1e9
        row["save_vs_raw_write"] = row["save_GBps"] / row["raw_write_GBps"]
        row["save_after_copy_vs_raw_write"] = (
            None if row["save_after_copy_GBps"] is None
            else row["save_after_copy_GBps"] / row["raw_write_GBps"])
        row["restore_vs_raw_read"] = row["disk_cold_GBps"] / row["raw_read_cold_GBps"]
        # the choice the runtime makes from the rates it measured in this run, vs the truth
        est_restore_s = row["file_bytes"] / row["disk_cold_rate_Bps"]
        row["choice"] = "restore" if est_prefill_s is None or est_restore_s <= est_prefill_s \
            else "prefill"
        row["best"] = "restore" if row["disk_cold_s"] <= row["cold_s"] else "prefill"
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    restored_on = f", restored on {args.restore_devices}" if args.restore_devices else ""
    print(f"\nprefix cache, {args.model} on {args.devices}{restored_on}; TTFT of an exact repeat "
          "(restore + first token)")
    print(f"{'tokens':>7} {'cold ms':>9} {'RAM ms':>8} {'disk cold ms':>12} {'disk warm ms':>12} "
          f"{'disk/cold':>9} {'restore GB/s cold|warm':>22} {'raw read cold|warm':>19} "
          f"{'save GB/s':>9} {'raw write':>9} {'save/raw':>8} {'copy wait s':>11} "
          f"{'choice/best':>15}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['cold_s'] * 1e3:>9.1f} {r['ram_s'] * 1e3:>8.1f} "
              f"{r['disk_cold_s'] * 1e3:>12.1f} {r['disk_warm_s'] * 1e3:>12.1f} "
              f"{r['disk_cold_s'] / r['cold_s']:>9.3f} "
              f"{r['disk_cold_GBps']:>10.2f} | {r['disk_warm_GBps']:<9.2f} "
              f"{r['raw_read_cold_GBps']:>8.2f} | {r['raw_read_warm_GBps']:<8.2f} "
              f"{r['save_GBps']:>9.2f} {r['raw_write_GBps']:>9.2f} "
              f"{r['save_vs_raw_write']:>8.3f} {r['save_copy_wait_s']:>11.3f} "
              f"{r['choice'] + '/' + r['best']:>15}")
        if args.check_tokens:
            print(f"{'':>7} {args.check_tokens} greedy tokens after the restore equal the saving "
                  f"run's: disk cold {r['disk_cold_same_tokens']}, disk warm "
                  f"{r['disk_warm_same_tokens']}")


if __name__ == "__main__":
    main()
