"""HTTP bodies fuzzed against a real `layersplit serve`, the campaign form of
`tests/launch/test_server.py::test_fuzzed_bodies_fail_alone`.

    python bench/http_fuzz.py --examples 5000

One server (the tiny seeded Llama of the tests, 2 shards, `--max-body-mb 0.25`); hypothesis
draws bad bodies for /v1/chat/completions, /v1/completions, /tokenize and /detokenize
(`tests/launch/http_fuzz.py`: wrong types, missing fields, huge numbers, nested junk, bytes that
are not UTF-8, lone surrogates, non-JSON, JSON cut short, oversized bodies with and without a
Content-Length, unknown fields, a wrong model). Counted per endpoint and mutation: answers
that are the expected 4xx with an OpenAI error JSON whose `param` names the field (or the body);
after each, the server process must be alive; every 100 cases and at the end a well-formed
completion must give the one-process reference's text, and /health must say ready.

Prints the counts; exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from layersplit.ipc.sockets import free_tcp_port  # noqa: E402
from layersplit.shards.tiny import write_tiny_checkpoint  # noqa: E402

from tests.launch.http_fuzz import cases, check_answer  # noqa: E402

MAX_BODY = 1 << 18


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    from layersplit.runtime.reference import ReferenceEngine
    from layersplit.shards.sampling import SamplingParams

    torch.set_num_threads(1)
    failures: list[str] = []
    counts: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "llama", "llama")
        ref = ReferenceEngine(model, prefill_chunk=16, max_context=512)
        want = ref.generate(ref.tokenizer.encode("well formed"),
                            SamplingParams(max_tokens=4, temperature=0)).text
        port = free_tcp_port()
        url = f"http://127.0.0.1:{port}"
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115
        server = subprocess.Popen(
            [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", str(model),
             "--devices", "cpu,cpu", "--threads", "1", "--prefill-chunk", "16", "--port",
             str(port), "--max-context", "512", "--max-body-mb", str(MAX_BODY / 2**20)],
            stdout=log, stderr=log)
        t0 = time.perf_counter()
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                print("the server did not start")
                return 1
            n = [0]

            def well_formed(when: str) -> None:
                r = httpx.post(url + "/v1/completions", timeout=60, json={
                    "model": "llama", "prompt": "well formed", "max_tokens": 4,
                    "temperature": 0})
                if r.status_code != 200 or r.json()["choices"][0]["text"] != want:
                    failures.append(f"{when}: the well-formed request got {r.status_code}: "
                                    f"{r.text[:200]}")
                counts["well-formed requests"] += 1
                if httpx.get(url + "/health", timeout=5).status_code != 200:
                    failures.append(f"{when}: /health is not 200")

            @settings(max_examples=args.examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=cases("llama", MAX_BODY))
            def one(case) -> None:
                try:
                    problem = check_answer(case, case.send(url))
                except httpx.HTTPError as e:
                    problem = f"HTTP failure: {e!r}"
                counts[(case.path, case.mutation, problem is None)] += 1
                if problem is not None:
                    failures.append(f"{case.mutation} to {case.path}: {problem} "
                                    f"{case.body[:300]!r}")
                if server.poll() is not None:
                    failures.append(f"the server exited ({server.returncode})")
                    raise SystemExit(1)
                n[0] += 1
                if n[0] % 100 == 0:
                    well_formed(f"after case {n[0]}")

            seed(args.seed)(one)()
            well_formed("at the end")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                rc = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                rc = "killed"
            log.close()
            if rc not in (0, -signal.SIGTERM):
                failures.append(f"the server stopped with {rc}")
        elapsed = time.perf_counter() - t0
    by_mutation: collections.Counter = collections.Counter()
    total = ok = 0
    for key, v in counts.items():
        if isinstance(key, tuple):
            _, mutation, good = key
            by_mutation[mutation] += v
            total += v
            ok += v if good else 0
    print(f"{total} bad bodies: {ok} answered with the expected 4xx and an error naming the "
          f"field, {total - ok} not; the server stayed up; {counts['well-formed requests']} "
          f"well-formed requests checked against the reference; {elapsed:.0f} s")
    print("per mutation: " + ", ".join(f"{m} {v}" for m, v in sorted(by_mutation.items())))
    per_path = collections.Counter()
    for key, v in counts.items():
        if isinstance(key, tuple):
            per_path[key[0]] += v
    print("per endpoint: " + ", ".join(f"{p} {v}" for p, v in sorted(per_path.items())))
    print(f"{len(failures)} failures")
    for f in failures[:50]:
        print("FAIL", f)
    print(json.dumps({"examples": total, "ok": ok, "failures": len(failures)}))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
