"""`layersplit serve` on GPUs: "ready" means the first request runs at the speed of the next ones
(`runtime.warmup`): its time to first token is at most 1.5 x the median of the ten after it, on
a fresh start and after a restart whose requests restore their prompts from the disk cache. Two
shards over cuda-ipc with a DFlash draft (speculative verify steps, the draft's compiled step).
The compile cache is a fresh one, so the first start compiles and autotunes during its warm-up
and writes its entries; the restart reuses them. Run on a CUDA machine:
`python -m pytest -m gpu tests/gpu/test_ready.py`."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest
import torch
from layersplit.ipc.sockets import free_tcp_port
from layersplit.shards.compile_cache import ROOT_ENV

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("fastapi", reason="the server extra (a device machine carries .whl-srv)")

SLACK_S = 0.05  # (a tiny model's TTFT is milliseconds: jitter aside, a compile costs seconds)


def _serve(model, draft, cache_dir, home, log):
    port = free_tcp_port()
    gpus = "cuda:0,cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0,cuda:0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", str(model),
         "--draft", str(draft), "--devices", gpus, "--transport", "cuda-ipc",
         "--max-context", "1024", "--prefill-chunk", "32", "--kv-cache-dir", str(cache_dir),
         "--port", str(port)],
        env={**os.environ, ROOT_ENV: str(home)}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 540
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, \
            f"the server died (exit {proc.returncode}): {_tail(log)}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become ready")


def _tail(log, lines: int = 30) -> str:
    """The end of the server's log (a file opened for writing)."""
    log.flush()
    with open(log.name, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _ttft(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens it took from the cache."""
    t0, first, cached = time.perf_counter(), None, 0
    with client.stream("POST", url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    assert first is not None
    return first, cached


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) in (0, -signal.SIGTERM)


def test_the_first_request_after_ready_is_as_fast_as_the_next(target, dflash, tmp_path):
    prompts = [[(i * 37 + j * 11) % 300 + 5 for j in range(100 + i)] for i in range(11)]
    client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    with open(tmp_path / "serve.log", "w") as log:
        for run in ("fresh", "restart"):
            proc, url = _serve(target, dflash, tmp_path / "kv", tmp_path / "compile", log)
            try:
                got = [_ttft(client, url, p + ([7, 8, 9] if run == "restart" else []))
                       for p in prompts]
            finally:
                _stop(proc)
            ttfts, cached = [g[0] for g in got], [g[1] for g in got]
            if run == "restart":  # (each restored its prompt's snapshots from disk)
                assert all(c >= 96 for c in cached), cached
            rest = statistics.median(ttfts[1:])
            assert ttfts[0] <= 1.5 * rest + SLACK_S, (run, ttfts)
    text = (tmp_path / "serve.log").read_text()
    assert "warming up from the compile cache" in text  # the restart reused the entries
    assert "tokens from the disk tier)" in text  # the restart's warm-up restored from disk
