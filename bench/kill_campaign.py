"""Campaigns of kill -9, on the CPU with a tiny seeded model.

    python bench/kill_campaign.py shards --trials 50
    python bench/kill_campaign.py save --trials 50
    python bench/kill_campaign.py draft --trials 50

`shards`: one `layersplit serve` (2 shards); each trial streams a long completion and kills a
random shard with SIGKILL at a random moment 0-1.5 s after the request was sent (prefill or
decode). Counted: the request ends with an error event within 2 s of the kill; the server
restarts its shards and answers the next request; the killed group's processes are gone. At the
end, after the server stops: no process and no /dev/shm segment left.

`save`: each trial runs `layersplit generate` on a new long prompt with a disk cache and kills
the coordinator with SIGKILL at a random moment 0-40 ms after its first partial file (.tmp)
appears (mid-save). Then a fresh coordinator starts on the directory. Counted: no partial file
left and no entry set aside as bad; the trial's prompt restores its longest complete cached
prefix (and not more); the output equals the cold output (tokens and logits); the shards of the
killed coordinator exit.

`draft`: each trial starts a `layersplit serve` with a draft process (1 shard, to start fast;
the draft is the tiny model itself, a classic draft whose proposals are kept, so every verify
step uses it), streams a greedy completion of 48 tokens that speculates, and kills the draft
with SIGKILL at a random moment of it: in prefill (0-0.3 s after sending, before any token; a
fifth of the trials) or 0-50 ms after the k-th chunk of text, k in 1..8 (decode).
Counted: the request either completes with exactly the plain (non-speculative) output of the
one-process reference, or ends with an error event within 2 s of the kill; the draft process is
gone, the next request is served with the exact output, and /health then says speculation is off;
the server stops on SIGTERM and leaves no process and no /dev/shm segment.

Prints the counts; exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from layersplit.ipc.sockets import free_tcp_port  # noqa: E402
from layersplit.shards.tiny import write_tiny_checkpoint  # noqa: E402

from tests.helpers import layersplit_shm, shard_children, wait_gone  # noqa: E402


def _wait_healthy(url: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def campaign_shards(model: Path, trials: int, rng: random.Random) -> list[str]:
    shm_before = layersplit_shm()
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", str(model), "--devices",
         "cpu,cpu", "--threads", "1", "--prefill-chunk", "16", "--port", str(port),
         "--max-context", "4096"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failures: list[str] = []
    errored = restarted = gone = 0
    latencies: list[float] = []
    try:
        if not _wait_healthy(url):
            return ["the server did not start"]
        for i in range(trials):
            kids = shard_children(server.pid)
            if len(kids) != 2:
                failures.append(f"trial {i}: {len(kids)} shards before the trial")
                _wait_healthy(url)
                continue
            victim = rng.choice(kids)
            delay = rng.uniform(0.0, 1.5)
            killed_at: list[float] = []

            def kill(victim=victim, killed_at=killed_at) -> None:
                killed_at.append(time.monotonic())
                try:
                    victim.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass

            timer = threading.Timer(delay, kill)
            last, error_at = None, None
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "llama", "prompt": f"trial {i} " * rng.randint(1, 40),
                    "max_tokens": 100000, "stream": True, "ignore_eos": True}) as r:
                timer.start()
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"error"' in line and error_at is None:
                        error_at = time.monotonic()
                        last = line
            timer.join()
            if error_at is None or not killed_at:
                failures.append(f"trial {i}: the request ended without an error ({last})")
            elif error_at - killed_at[0] > 2.0:
                failures.append(f"trial {i}: the error came {error_at - killed_at[0]:.2f} s "
                                "after the kill")
            else:
                errored += 1
                latencies.append(error_at - killed_at[0])
            if wait_gone([k.pid for k in kids], timeout=10) == []:
                gone += 1
            else:
                failures.append(f"trial {i}: processes of the killed group still run")
            if not _wait_healthy(url):
                failures.append(f"trial {i}: the server did not come back")
                break
            try:
                r = httpx.post(url + "/v1/completions", timeout=60, json={
                    "model": "llama", "prompt": "after", "max_tokens": 3, "temperature": 0})
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3:
                    restarted += 1
                else:
                    failures.append(f"trial {i}: the next request got {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(f"trial {i}: the next request failed: {e}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            failures.append("the server did not stop on SIGTERM")
    time.sleep(1.0)
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if f"--parent-pid {server.pid}" in " ".join(p.info["cmdline"] or [])]
    leaked = layersplit_shm() - shm_before
    print(f"shards: {trials} trials: {errored} requests errored within 2 s of the kill "
          f"(max {max(latencies, default=0):.2f} s, median "
          f"{sorted(latencies)[len(latencies) // 2] if latencies else 0:.2f} s), {gone} killed "
          f"groups gone, {restarted} next requests served; after the server stopped: "
          f"{len(leftovers)} processes, {len(leaked)} /dev/shm segments left")
    if leftovers or leaked:
        failures.append(f"left behind: processes {leftovers}, segments {sorted(leaked)}")
    return failures


def _spawn_server(model: Path, port: int, *extra: str, devices: str = "cpu,cpu",
                  log: Path | None = None) -> subprocess.Popen:
    """A `layersplit serve` of the tiny model; its stderr goes to `log` (default: nowhere)."""
    if log is None:
        stderr = subprocess.DEVNULL
    else:
        stderr = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", str(model),
             "--devices", devices, "--threads", "1", "--prefill-chunk", "16", "--port",
             str(port), "--max-context", "4096", *extra], stdout=subprocess.DEVNULL,
            stderr=stderr)
    finally:
        if log is not None:
            os.close(stderr)  # (the child has its own copy)


def _stream_completion(url: str, body: dict, on_chunk=None) -> tuple[str, str | None,
                                                                      str | None, float]:
    """Streams one completion: (text, finish_reason, error event or None, monotonic time the
    error event or the end came). `on_chunk(n)` is called after the n-th chunk with text."""
    text, finish, error, chunks = "", None, None, 0
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = line
                break
            for c in event.get("choices", []):
                text += c.get("text") or ""
                finish = c.get("finish_reason") or finish
                if c.get("text") and on_chunk is not None:
                    chunks += 1
                    on_chunk(chunks)
    return text, finish, error, time.monotonic()


def campaign_draft(model: Path, trials: int, rng: random.Random, work: Path) -> list[str]:
    from layersplit.runtime.reference import ReferenceEngine
    from layersplit.shards.sampling import SamplingParams

    max_tokens = 48
    prompts = [f"prompt {k}: the quick brown fox jumps over the lazy dog " * (1 + 3 * k)
               for k in range(4)]  # 1 to 4 prefill chunks of 16
    ref = ReferenceEngine(model, prefill_chunk=16, max_context=4096)
    plain = {p: ref.generate(ref.tokenizer.encode(p), SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True)).text for p in prompts}
    shm_before = layersplit_shm()
    failures: list[str] = []
    exact = errored = draft_gone = spec_off = next_ok = clean = after_end = in_prefill = 0
    error_s: list[float] = []  # kill -> error event
    done_s: list[float] = []  # kill -> end, of requests that completed
    body = {"model": "llama", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    done = 0
    try:
        for i in range(trials):
            port = free_tcp_port()
            url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            log = work / f"server-{i}.log"
            server = _spawn_server(model, port, "--draft", str(model), devices="cpu", log=log)
            fail: list[str] = []
            try:
                if not _wait_healthy(url, timeout=600):  # (a loaded machine: minutes)
                    fail.append("the server did not start")
                    continue
                health = httpx.get(url + "/health", timeout=5).json()
                drafts = [k for k in shard_children(server.pid) if " draft " in
                          " ".join(k.cmdline())]
                if len(drafts) != 1 or not health.get("speculation", "").startswith("on"):
                    fail.append(f"{len(drafts)} draft processes, speculation {health}")
                    continue
                prompt = rng.choice(prompts)
                killed_at: list[float] = []
                seen = [0, -1]  # chunks of text so far; chunks when the kill came

                def kill(victim=drafts[0], killed_at=killed_at, seen=seen) -> None:
                    killed_at.append(time.monotonic())
                    seen[1] = seen[0]
                    try:
                        victim.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        pass

                # the moment: in prefill (0-0.3 s after sending, before any token), or 0-50 ms
                # after the k-th chunk of text (k in 1..8; a verify step keeps up to 5 tokens)
                k = 0 if rng.random() < 0.2 else rng.randint(1, 8)
                timer = threading.Timer(rng.uniform(0.0, 0.3 if k == 0 else 0.05), kill)
                if k == 0:
                    timer.start()

                def on_chunk(n: int, k=k, timer=timer, seen=seen) -> None:
                    seen[0] = n
                    if n == k:
                        timer.start()

                sent = time.monotonic()
                text, finish, error, ended = _stream_completion(url, {**body, "prompt": prompt},
                                                                on_chunk)
                if k and not timer.is_alive() and not killed_at:
                    timer.start()  # fewer chunks than k: kill now (counted as after the end)
                timer.join()
                if killed_at[0] >= ended:
                    after_end += 1
                elif seen[1] == 0:
                    in_prefill += 1
                print(f"trial {i}: started in {sent - started:.1f} s, killed at "
                      f"{killed_at[0] - sent:.2f} s (k={k}), the request ended at "
                      f"{ended - sent:.2f} s{' with an error' if error else ''}", flush=True)
                if error is not None:
                    if ended - killed_at[0] > 2.0:
                        fail.append(f"the error came {ended - killed_at[0]:.2f} s after the kill")
                    else:
                        errored += 1
                        error_s.append(ended - killed_at[0])
                elif text == plain[prompt] and finish == "length":
                    exact += 1
                    done_s.append(max(0.0, ended - killed_at[0]))
                else:
                    fail.append(f"the request completed with another output ({text!r}, finish "
                                f"{finish}) than the plain one ({plain[prompt]!r})")
                if wait_gone([drafts[0].pid], timeout=10) == []:
                    draft_gone += 1
                else:
                    fail.append("the killed draft process still runs")
                p2 = rng.choice(prompts)
                r = httpx.post(url + "/v1/completions", timeout=120, json={**body, "prompt": p2})
                if r.status_code == 200 and r.json()["choices"][0]["text"] == plain[p2]:
                    next_ok += 1
                else:
                    fail.append(f"the next request got {r.status_code}: {r.text[:200]}")
                health = httpx.get(url + "/health", timeout=5).json()
                if health.get("status") == "ready" and health.get("speculation", "").startswith(
                        "off"):
                    spec_off += 1
                else:
                    fail.append(f"/health after the next request: {health}")
            except httpx.HTTPError as e:
                fail.append(f"HTTP failure: {e!r}")
            finally:
                kids = [k.pid for k in psutil.Process(server.pid).children(recursive=True)]
                server.send_signal(signal.SIGTERM)
                try:
                    rc = server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(10)
                    rc = None
                left = wait_gone(kids, timeout=10)
                if rc in (0, -signal.SIGTERM) and not left:
                    clean += 1
                else:
                    fail.append(f"the server stopped with {rc}, processes left: {left}")
                failures += [f"trial {i}: {f}" for f in fail]
                if fail:
                    print(f"trial {i} FAILED: {fail}; the server's log:\n"
                          f"{log.read_text()[-3000:]}", flush=True)
                print(f"trial {i}: {time.monotonic() - started:.1f} s in all", flush=True)
                done = i + 1
    except SystemExit:  # SIGTERM: count the trials done so far
        print(f"stopped by a signal after {done} trials", flush=True)
        trials = done

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else 0.0

    leaked = layersplit_shm() - shm_before
    print(f"draft: {trials} trials ({in_prefill} killed before the first token, {after_end} "
          f"after the request ended): {exact} requests completed with the exact plain output "
          f"(ended a median {median(done_s):.2f} s, at most {max(done_s, default=0):.2f} s "
          f"after the kill), {errored} ended with an error within 2 s of the kill (max "
          f"{max(error_s, default=0):.2f} s); {draft_gone} killed drafts gone, {next_ok} next "
          f"requests served exactly, {spec_off} servers reported speculation off then, {clean} "
          f"servers stopped cleanly with no process left; {len(leaked)} /dev/shm segments left")
    if leaked:
        failures.append(f"segments left: {sorted(leaked)}")
    return failures


def campaign_save(model: Path, trials: int, rng: random.Random, work: Path) -> list[str]:
    import numpy as np
    from layersplit.runtime.cache_admin import verify
    from layersplit.runtime.config import RuntimeConfig
    from layersplit.runtime.coordinator import Coordinator
    from layersplit.runtime.reference import ReferenceEngine
    from layersplit.shards.sampling import SamplingParams
    from safetensors import safe_open

    from tests.helpers import run_logged

    d = work / "kv"
    ref = ReferenceEngine(model, prefill_chunk=16, max_context=4096)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    cfg = RuntimeConfig(model=str(model), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=4096, threads=1, kv_cache_dir=str(d))
    failures: list[str] = []
    mid_save = restored_ok = 0
    shm_before = layersplit_shm()
    for i in range(trials):
        text = f"trial {i}: a rather long prompt about foxes and dogs and cats " * 30
        p = subprocess.Popen(
            [sys.executable, "-m", "layersplit.launch.cli", "generate", text, "--model", str(model),
             "--devices", "cpu,cpu", "--threads", "1", "--prefill-chunk", "16",
             "--kv-cache-dir", str(d), "--max-tokens", "100000", "--ignore-eos",
             "--max-context", "4096", "--json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kids = []
        deadline = time.monotonic() + 120
        seen = set(d.glob("*.safetensors")) if d.exists() else set()
        while time.monotonic() < deadline and p.poll() is None:
            kids = kids or shard_children(p.pid)
            if d.exists() and (list(d.glob("*.tmp")) or set(d.glob("*.safetensors")) - seen):
                break
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.04))
        if d.exists() and list(d.glob("*.tmp")):
            mid_save += 1
        p.kill()
        p.wait(10)
        if wait_gone([k.pid for k in kids], timeout=10):
            failures.append(f"trial {i}: shards of the killed coordinator still run")
        complete = sorted(d.glob("*.safetensors"))
        bad = [f.name for f in complete if verify(f) is not None]
        if bad:
            failures.append(f"trial {i}: visible entries that do not verify: {bad}")
        ids = ref.tokenizer.encode(text)
        longest = 0
        for f in complete:
            with safe_open(str(f), "pt") as st:
                toks = st.get_tensor("tokens").tolist()
            if toks == ids[:len(toks)]:
                longest = max(longest, len(toks))
        with Coordinator(cfg) as c:
            tmp_left = list(d.glob("*.tmp"))
            got, logits = run_logged(c, ids, greedy)
            want, want_logits = run_logged(ref, ids, greedy)
            stats = c.cache.stats
            problems = []
            if tmp_left:
                problems.append(f"partial files left: {[t.name for t in tmp_left]}")
            if stats.bad_files:
                problems.append(f"{stats.bad_files} entries set aside as bad")
            if got.cached_tokens != longest:
                problems.append(f"restored {got.cached_tokens} tokens, {longest} were complete")
            if got.tokens != want.tokens or not np.array_equal(logits, want_logits):
                problems.append(f"output differs from the cold output ({got.tokens} vs "
                                f"{want.tokens}, {logits.shape} vs {want_logits.shape}, "
                                f"restored {got.cache_tier} {got.cached_tokens})")
            if problems:
                failures.append(f"trial {i}: " + "; ".join(problems))
            else:
                restored_ok += 1
    leaked = layersplit_shm() - shm_before
    print(f"save: {trials} trials ({mid_save} killed while a .tmp existed): {restored_ok} next "
          f"starts found no partial entry and restored every complete one with the cold "
          f"output; {len(leaked)} /dev/shm segments left")
    if leaked:
        failures.append(f"segments left: {sorted(leaked)}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["shards", "save", "draft"])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    import torch

    torch.set_num_threads(1)  # the reference's arithmetic is the one-thread shards'
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "llama", "llama")
        t0 = time.perf_counter()
        if args.which == "shards":
            failures = campaign_shards(model, args.trials, rng)
        elif args.which == "draft":
            failures = campaign_draft(model, args.trials, rng, Path(tmp))
        else:
            failures = campaign_save(model, args.trials, rng, Path(tmp))
    print(f"{len(failures)} failed trials in {time.perf_counter() - t0:.0f} s")
    for f in failures:
        print("FAIL", f)
    print(json.dumps({"which": args.which, "trials": args.trials, "failures": len(failures)}))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server is stopped first
    raise SystemExit(main())
