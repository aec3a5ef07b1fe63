"""Soak: concurrent streaming clients against `layersplit serve` for a while.

    nice -n 10 python bench/soak.py --clients 32 --minutes 10 --json soak.json

One `layersplit serve --config configs/smollm2-cpu.toml` (the default model, SmolLM2-135M, on
two CPU shard processes; its GGUF from `runtime.model_store.fetch_default_model`, cached after
the first fetch) with `--cache-ram-gb 0.5`, so that the prefix cache's RAM tier fills early in
the run and what it holds stops growing: growth after that is a leak, not a cache. Each client
streams chat or text completions back to back (a shared system prompt, a question of its own,
16-64 tokens, sampled with a seed) until the time is up (streams still running `--drain` s
later are cut: their clients disconnect), and checks each stream: status 200, no error event, a
finish reason and `data: [DONE]`, as many tokens as `usage` says.

Every `--every` seconds it samples, for the server and each of its child processes (shards,
draft): RSS, open file descriptors and threads; and the /dev/shm segments named layersplit-*.
It reports per process the RSS slope (least squares, MB per minute) over the whole run and over
the run after its first third (warm-up: allocator pools, the cache filling), and the first and
last values of each count. Exit status 1 on any client error or a process gone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from layersplit.ipc.sockets import free_tcp_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TOPICS = ["the tides", "prime numbers", "photosynthesis", "the printing press", "volcanoes",
          "sourdough bread", "the moon's phases", "binary search", "jazz", "glaciers",
          "the Roman roads", "tea", "magnets", "bees", "the metric system", "chess openings"]


def _processes(server: psutil.Process) -> dict[str, psutil.Process]:
    out = {"server": server}
    for child in server.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        at = [i for i, part in enumerate(cmd) if part.endswith("launch.cli")]
        if not at or len(cmd) <= at[0] + 1:
            continue
        role = cmd[at[0] + 1]  # shard, draft
        idx = cmd[cmd.index("--index") + 1] if "--index" in cmd else ""
        out[f"{role}{idx}"] = child
    return out


def _shm() -> int:
    return sum(1 for p in Path("/dev/shm").glob("layersplit-*"))


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes), in MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 60 / 1e6 if var else 0.0


class Stats:
    def __init__(self) -> None:
        self.requests = self.tokens = self.cut = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []


async def client(i: int, url: str, stop_at: float, stats: Stats) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        while time.monotonic() < stop_at:
            chat = rng.random() < 0.5
            topic = rng.choice(TOPICS)
            max_tokens = rng.randint(16, 64)
            body: dict = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens,
                          "stream": True, "temperature": 0.7, "seed": rng.randrange(1 << 30),
                          "stream_options": {"include_usage": True}}
            if chat:
                body["messages"] = [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Client {i}: tell me about "
                                                                f"{topic}."}]
            else:
                body["prompt"] = f"{SYSTEM}\nClient {i} asks about {topic}. Answer:"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            t0 = time.monotonic()
            chunks = finish = usage = None
            done = False
            try:
                async with http.stream("POST", url + path, json=body) as r:
                    if r.status_code != 200:
                        stats.errors.append(f"client {i}: {r.status_code} "
                                            f"{(await r.aread())[:200]!r}")
                        continue
                    chunks = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            stats.errors.append(f"client {i}: error event {line[:300]}")
                            break
                        usage = event.get("usage") or usage
                        for c in event.get("choices", []):
                            finish = c.get("finish_reason") or finish
                            chunks += 1
            except (httpx.HTTPError, ValueError) as e:
                stats.errors.append(f"client {i}: {e!r}")
                continue
            except asyncio.CancelledError:  # the run is over: this stream is cut (disconnect)
                stats.cut += 1
                raise
            if not done or finish is None or usage is None:
                stats.errors.append(f"client {i}: stream ended without [DONE], a finish reason "
                                    f"or usage ({done}, {finish}, {usage})")
                continue
            n = usage["completion_tokens"]
            if not 0 <= n <= max_tokens or (finish == "length" and n != max_tokens):
                stats.errors.append(f"client {i}: {n} tokens for max_tokens {max_tokens}, "
                                    f"finish {finish}")
                continue
            stats.requests += 1
            stats.tokens += n
            stats.latencies.append(time.monotonic() - t0)


async def sampler(server: psutil.Process, t0: float, stop_at: float, every: float,
                  samples: list[dict]) -> None:
    while True:
        row: dict = {"t": round(time.monotonic() - t0, 1), "shm": _shm(), "procs": {}}
        for name, p in _processes(server).items():
            try:
                with p.oneshot():
                    row["procs"][name] = {"pid": p.pid, "rss": p.memory_info().rss,
                                          "fds": p.num_fds(), "threads": p.num_threads()}
            except psutil.NoSuchProcess:
                pass
        samples.append(row)
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every, max(0.0, stop_at - time.monotonic())))


def report(samples: list[dict], warm_from: float) -> tuple[list[str], dict]:
    lines, summary = [], {}
    names = sorted({n for s in samples for n in s["procs"]})
    for name in names:
        pts = [(s["t"], s["procs"][name]["rss"]) for s in samples if name in s["procs"]]
        late = [(t, v) for t, v in pts if t >= warm_from]
        fds = [s["procs"][name]["fds"] for s in samples if name in s["procs"]]
        thr = [s["procs"][name]["threads"] for s in samples if name in s["procs"]]
        pids = {s["procs"][name]["pid"] for s in samples if name in s["procs"]}
        summary[name] = {"rss_first_mb": pts[0][1] / 1e6, "rss_last_mb": pts[-1][1] / 1e6,
                         "rss_max_mb": max(v for _, v in pts) / 1e6,
                         "slope_mb_per_min": _slope(pts), "slope_after_warmup": _slope(late),
                         "fds": [fds[0], max(fds), fds[-1]], "threads": [thr[0], max(thr),
                                                                         thr[-1]],
                         "pids": sorted(pids)}
        s = summary[name]
        lines.append(f"{name:>8}: RSS {s['rss_first_mb']:.0f} -> {s['rss_last_mb']:.0f} MB "
                     f"(max {s['rss_max_mb']:.0f}), slope {s['slope_mb_per_min']:+.2f} MB/min, "
                     f"after {warm_from:.0f} s {s['slope_after_warmup']:+.2f} MB/min; open fds "
                     f"{fds[0]} -> {fds[-1]} (max {max(fds)}); threads {thr[0]} -> {thr[-1]} "
                     f"(max {max(thr)}); pids {sorted(pids)}")
    shm = [s["shm"] for s in samples]
    summary["shm"] = [shm[0], max(shm), shm[-1]]
    lines.append(f"/dev/shm layersplit-* segments: {shm[0]} -> {shm[-1]} (max {max(shm)})")
    return lines, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds the streams running "
                    "at the end get to finish before their clients disconnect")
    ap.add_argument("--json", help="write the samples and the summary here")
    ap.add_argument("server_args", nargs="*", help="more `layersplit serve` flags (after --)")
    args = ap.parse_args()
    from layersplit.runtime.model_store import fetch_default_model

    fetch_default_model()  # (cached: no network after the first time)
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "serve", "--config",
           str(ROOT / "configs" / "smollm2-cpu.toml"), "--port", str(port), "--cache-ram-gb",
           "0.5", *args.server_args]
    log_path = Path(args.json or "soak").with_suffix(".server.log")
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    shm_before = _shm()
    failures: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                print(f"the server exited: see {log_path}")
                return 1
            time.sleep(0.5)
        else:
            print("the server did not start")
            return 1
        print(f"serving: {' '.join(cmd)}; {args.clients} clients for {args.minutes} min",
              flush=True)
        server = psutil.Process(proc.pid)
        stats, samples = Stats(), []
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def run() -> None:
            clients = [asyncio.create_task(client(i, url, stop_at, stats))
                       for i in range(args.clients)]
            await sampler(server, t0, stop_at, args.every, samples)
            # streams still running after --drain seconds more are cut (the clients go away)
            _, late = await asyncio.wait(clients, timeout=args.drain)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

        asyncio.run(run())
        elapsed = time.monotonic() - t0
        healthy = httpx.get(url + "/health", timeout=30).status_code == 200
        if not healthy:
            failures.append("/health is not 200 after the run")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        restarts = [ln for ln in metrics.splitlines()
                    if ln.startswith("layersplit_shard_restarts_total")]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
        log.close()
    time.sleep(1.0)
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if f"--parent-pid {proc.pid}" in " ".join(p.info["cmdline"] or [])]
    lat = sorted(stats.latencies)
    lines, summary = report(samples, warm_from=args.minutes * 60 / 3)
    print(f"{stats.requests} streams completed ({stats.tokens} tokens, "
          f"{stats.tokens / elapsed:.1f} tokens/s) in {elapsed:.0f} s by {args.clients} "
          f"clients, {stats.cut} cut at the end; {len(stats.errors)} errors; stream time median "
          f"{lat[len(lat) // 2] if lat else 0:.1f} s, max {lat[-1] if lat else 0:.1f} s; "
          f"shard restarts: {restarts}")
    for line in lines:
        print(line)
    print(f"after the server stopped (exit {rc}): {len(left)} processes and "
          f"{_shm() - shm_before} /dev/shm segments left")
    for e in stats.errors[:20]:
        print("ERROR", e)
    firsts = {n: s["pids"] for n, s in summary.items() if isinstance(s, dict) and "pids" in s}
    if any(len(p) > 1 for p in firsts.values()):
        failures.append(f"a process was replaced during the run: {firsts}")
    if stats.errors or left or _shm() > shm_before or rc not in (0, -signal.SIGTERM):
        failures.append("errors, leftovers or an unclean stop")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cmd": cmd, "clients": args.clients, "minutes": args.minutes,
            "requests": stats.requests, "tokens": stats.tokens, "errors": stats.errors,
            "summary": summary, "samples": samples}, indent=1))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
