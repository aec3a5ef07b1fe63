"""A scripted agent conversation against `layersplit serve` (and, for comparison, llama.cpp's
server, llama-cpp-python's `python -m llama_cpp.server`, where it is installed): a fixed system
prompt, then turns of a tool result and the assistant's answer; the server is stopped at turn
N/2 and started again on the same cache directory. Per turn: TTFT, cached tokens, tokens
prefilled, decode tok/s; a table last, and `--json` for bench/results_row.py (`agent`).

    python bench/agent_session.py --model default --devices cpu,cpu --turns 6 \\
        --system-tokens 512 --tool-tokens 50,400 --answer-tokens 20,100
    python bench/agent_session.py --model default --devices cuda:0,cuda:0 --turns 10 \\
        --llamacpp $LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf --json agent.json

Each turn of ours also reads the server's time to its first token phase by phase (its
/metrics, `layersplit_time_to_first_token_phase_seconds`): `prefill` is the steps of the new
tokens alone, the rest is everything else (parsing, tokenizing, waiting, restoring), and
`outside` the TTFT outside the server's clock (HTTP and the connection both ways, the client);
the table gives both, and the medians from turn 2 (the turn after the restart left out) with
TTFT / prefill. The client keeps its connection across turns, as an agent's does: TTFT is
measured from the request's send, not from building a client.

The sizes default to the agent shape: a system prompt of about 2,048 tokens, tool results of
200-2,000 tokens and answers of 100-1,000 tokens (spread evenly over the turns, largest last).
Answers run to their max_tokens (the end-of-turn token is not sampled: `ignore_eos` for ours,
a logit bias for llama.cpp's). Each server runs with its prompt cache (ours: RAM and disk;
llama.cpp's: its disk cache in the same directory across the restart).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from layersplit.runtime.model_store import resolve_model  # noqa: E402
from layersplit.runtime.tokenizer import TextTokenizer  # noqa: E402

WORDS = ("the agent reads the repository then edits a module runs its tests and reports what "
         "changed in each file with the line numbers and the reason for every edit").split()


def filler(tok: TextTokenizer, n: int, seed: int) -> str:
    """Text of about `n` tokens (deterministic in `seed`)."""
    words, i = [], seed
    while True:
        for _ in range(32):
            words.append(WORDS[i % len(WORDS)] + ("," if i % 7 == 0 else ""))
            i = (i * 31 + 7) % 1009
        text = " ".join(words)
        if len(tok.encode(text)) >= n:
            return text


def spread(lo_hi: str, turns: int) -> list[int]:
    lo, hi = (int(x) for x in lo_hi.split(","))
    return [round(lo + (hi - lo) * i / max(1, turns - 1)) for i in range(turns)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One server process on a port of its own, started again by `restart` (same command,
    same working directory: the same cache)."""

    def __init__(self, name: str, cmd: list[str], cwd: Path, log: Path, ready_path: str,
                 ready_s: float = 600) -> None:
        self.name, self.cmd, self.cwd, self.log = name, cmd, cwd, log
        self.ready_path, self.ready_s = ready_path, ready_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=log, stderr=log)
        t0, deadline = time.perf_counter(), time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    self.ready_after = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready in {self.ready_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> float:
        self.stop()
        self.start()
        return self.ready_after


def ask(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int,
        extra: dict) -> dict:
    """One streamed chat turn: its text and timings, and the usage the server reports. `client`
    is the session's (its connection kept alive across turns, as an agent's HTTP client keeps
    it): building a client per turn would count its setup (httpx loads its CA bundle, ~20 ms)
    and a new TCP connection in the TTFT."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    first = last = None
    text, usage, pieces = [], None, 0
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    pieces += 1
                    text.append(piece)
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    n = usage.get("completion_tokens", pieces)
    return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - t0,
            "total_s": time.perf_counter() - t0, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": n, "cached_tokens": details.get("cached_tokens"),
            "decode_tok_s": (n - 1) / (last - first) if first and last and last > first and n > 1
            else 0.0}


PHASES = "layersplit_time_to_first_token_phase_seconds_sum"


def phase_sums(client: httpx.Client, url: str) -> dict[str, float]:
    """The server's summed time-to-first-token phases so far, in seconds (its /metrics:
    `layersplit_time_to_first_token_phase_seconds`); {} from a server without them."""
    try:
        text = client.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for m in re.finditer(PHASES + r'\{phase="(\w+)"\} (\S+)', text):
        out[m.group(1)] = float(m.group(2))
    return out


def turn_phases(ttft_s: float, before: dict[str, float], after: dict[str, float]
                ) -> dict[str, float]:
    """A turn's TTFT phase by phase, in ms: the server's (the difference of its sums before and
    after the turn), then `outside`: the rest of the client's TTFT, outside the server's clock
    (the request's way from the client to the server's handler, the first token's chunk's way
    back: HTTP, the connection, the client). {} without the server's phases."""
    if not after:
        return {}
    out = {k: (v - before.get(k, 0.0)) * 1e3 for k, v in after.items()}
    out["outside"] = ttft_s * 1e3 - sum(out.values())
    return out


def host_ms(t: dict) -> float | None:
    """A turn's time to its first token in the server other than its prefill's steps."""
    p = t.get("phases_ms")
    return sum(v for k, v in p.items() if k not in ("prefill", "outside")) if p else None


def conversation(tok: TextTokenizer, args) -> tuple[str, list[str], list[int]]:
    """(system prompt, tool results, answer lengths) of the scripted session."""
    system = ("You are a coding agent. You read files and run commands through tools, then "
              "explain what you found. Reference manual follows.\n"
              + filler(tok, args.system_tokens, 1))
    tools = [f"Tool result (read_file src/module_{i}.py):\n" + filler(tok, n, 100 + i)
             for i, n in enumerate(spread(args.tool_tokens, args.turns))]
    return system, tools, spread(args.answer_tokens, args.turns)


def run_session(name: str, server: Served, tok: TextTokenizer, args, extra: dict) -> dict:
    system, tools, answers = conversation(tok, args)
    client = httpx.Client()  # (one per server run: its connection is kept across turns)
    model = client.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Find why the tests of the cache module fail and "
                                            "fix them. Start by reading the sources."}]
    turns, t0, away = [], time.perf_counter(), 0.0
    sums = phase_sums(client, server.url)
    for i in range(args.turns):
        restart = None
        if i == args.turns // 2 and i > 0:
            t_r = time.perf_counter()
            restart = server.restart()  # (until it is ready)
            away = time.perf_counter() - t_r
            client.close()
            client = httpx.Client()  # (its connection opened by the first /metrics)
            sums = phase_sums(client, server.url)
        messages.append({"role": "user", "content": tools[i]})
        r = ask(client, server.url, model, messages, answers[i], extra)
        r.update(turn=i + 1, restart_s=restart, answer_tokens_asked=answers[i])
        now = phase_sums(client, server.url)  # (the server's phases of this turn's first token)
        if now:
            r["phases_ms"] = turn_phases(r["ttft_s"], sums, now)
        sums = now
        if r["cached_tokens"] is not None and r["prompt_tokens"] is not None:
            r["prefilled"] = r["prompt_tokens"] - r["cached_tokens"]
        turns.append(r)
        messages.append({"role": "assistant", "content": r.pop("text")})
        ph = r.get("phases_ms")
        print(f"{name:>10} turn {i + 1:2d}: prompt {r['prompt_tokens']} cached "
              f"{r['cached_tokens']} ttft {r['ttft_s'] * 1e3:.1f} ms, "
              f"{r['completion_tokens']} tokens at {r['decode_tok_s']:.1f} tok/s"
              + (f" (after a restart, ready in {restart:.1f} s)" if restart else "")
              + (" [" + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()) + " ms]"
                 if ph else ""), flush=True)
    client.close()
    return {"server": name, "turns": turns,
            "session_s": time.perf_counter() - t0 - away}  # (the restart left out)


def later_turns(res: dict) -> list[dict]:
    """The turns from the second on, the one after the restart left out (its prefix comes
    from the disk)."""
    return [t for t in res["turns"][1:] if not t["restart_s"]]


def summary(res: dict) -> dict:
    """Medians over `later_turns`, in ms: TTFT, the server's prefill of the new tokens (its
    `prefill` phase), the rest of the server's time to the first token, TTFT / prefill."""
    later = later_turns(res)
    out = {"ttft_ms": statistics.median(t["ttft_s"] for t in later) * 1e3} if later else {}
    timed = [t for t in later if t.get("phases_ms", {}).get("prefill")]
    if timed:
        out.update(prefill_ms=statistics.median(t["phases_ms"]["prefill"] for t in timed),
                   host_ms=statistics.median(host_ms(t) for t in timed),
                   ttft_over_prefill=statistics.median(
                       t["ttft_s"] * 1e3 / t["phases_ms"]["prefill"] for t in timed))
    return out


def table(results: list[dict]) -> None:
    print("\n| server | turn | prompt | cached | prefilled | TTFT ms | prefill ms | rest ms | "
          "decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for t in res["turns"]:
            mark = " (restart)" if t["restart_s"] else ""
            ph, rest = t.get("phases_ms") or {}, host_ms(t)
            print(f"| {res['server']} | {t['turn']}{mark} | {t['prompt_tokens']} | "
                  f"{t['cached_tokens'] if t['cached_tokens'] is not None else '—'} | "
                  f"{t.get('prefilled', '—')} | {t['ttft_s'] * 1e3:.1f} | "
                  + (f"{ph['prefill']:.1f}" if "prefill" in ph else "—") + " | "
                  + (f"{rest:.1f}" if rest is not None else "—") + " | "
                  f"{t['decode_tok_s']:.1f} |")
        s = summary(res)
        if s:
            print(f"| {res['server']} | medians from turn 2 (restart excluded) | | | | "
                  f"{s['ttft_ms']:.1f} | "
                  + (f"{s['prefill_ms']:.1f} | {s['host_ms']:.1f} | TTFT / prefill "
                     f"{s['ttft_over_prefill']:.2f}; " if "prefill_ms" in s else "— | — | ")
                  + f"session {res['session_s']:.2f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--tool-tokens", default="200,2000", help="smallest,largest tool result")
    ap.add_argument("--answer-tokens", default="100,1000", help="shortest,longest answer")
    ap.add_argument("--max-context", type=int, default=0,
                    help="0: what the conversation needs, rounded up to 1,024")
    ap.add_argument("--llamacpp", default="", help="a GGUF: the same session against "
                                                   "llama-cpp-python's server, where installed")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra `layersplit serve` argument (repeatable)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    model_path = resolve_model(args.model)
    tok = TextTokenizer.for_model(model_path)
    if tok is None:
        raise SystemExit(f"{model_path} has no tokenizer: the session needs a chat template")
    need = args.system_tokens + sum(spread(args.tool_tokens, args.turns)) + \
        sum(spread(args.answer_tokens, args.turns)) + 64 * args.turns + 256
    ctx = args.max_context or -(-need // 1024) * 1024
    work = Path(tempfile.mkdtemp(prefix="agent-session-"))
    results = []
    try:
        ours = Served("layersplit", [
            sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", args.model,
            "--devices", args.devices, "--port", "{port}", "--max-context", str(ctx),
            "--kv-cache-dir", str(work / "kv"), *args.serve_arg], ROOT, work / "ours.log",
            "/health")
        try:
            results.append(run_session("layersplit", ours, tok, args, {"ignore_eos": True}))
        finally:
            ours.stop()
        if args.llamacpp:
            results += llamacpp_session(args, tok, ctx, work)
    finally:
        if os.environ.get("AGENT_KEEP_LOGS"):
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "devices": args.devices, "turns": args.turns,
             "system_tokens": args.system_tokens, "tool_tokens": args.tool_tokens,
             "answer_tokens": args.answer_tokens, "results": results}, indent=1))
    return 0


def llamacpp_session(args, tok: TextTokenizer, ctx: int, work: Path) -> list[dict]:
    """The same session against llama-cpp-python's server (all layers on the GPU where it was
    built with one), with its disk prompt cache in a directory kept across the restart."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        print(f"llama.cpp's server is not installed ({e}): no comparison", flush=True)
        return []
    (work / "lcp").mkdir()
    eos = tok.eos_ids[0] if tok.eos_ids else None
    try:
        lcp = Served("llama.cpp", [
            sys.executable, "-m", "llama_cpp.server", "--model", args.llamacpp, "--host",
            "127.0.0.1", "--port", "{port}", "--n_ctx", str(ctx), "--n_gpu_layers", "-1",
            "--cache", "true", "--cache_type", "disk"], work / "lcp", work / "lcp.log",
            "/v1/models")
    except RuntimeError as e:
        log = work / "lcp.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        print(f"llama.cpp's server did not start: {e}", *tail, sep="\n", flush=True)
        return []
    try:
        extra = {"logit_bias": {str(eos): -100}} if eos is not None else {}
        return [run_session("llama.cpp", lcp, tok, args, extra)]
    except (RuntimeError, httpx.HTTPError) as e:  # (ours is measured: the comparison is not)
        print(f"llama.cpp's session failed: {e}; see {work / 'lcp.log'}", flush=True)
        return []
    finally:
        lcp.stop()


if __name__ == "__main__":
    raise SystemExit(main())
