"""Is "ready" ready? The time to first token of the first requests `layersplit serve` answers
after it says it is ready, against the median of the requests after them, on a fresh server and
after a restart on the same cache directory.

    python bench/first_request.py --model default --devices cpu,cpu
    python bench/first_request.py --model default --devices cuda:0,cuda:0 --json first.json

A run is `--requests` chat requests, one after another, each a prompt of its own of about
`--prompt-tokens` tokens (a distinct first line, so no prompt shares a prefix with another):
on the fresh server each is prefilled cold; then the server is stopped (SIGTERM, its saves
finished) and started again on the same cache directory, and the same prompts come again, so
each is restored from the disk tier. Within each phase the requests do the same work, so the
first's TTFT over the median of the others is what the start left to the first request
(compilation, autotuning, graph captures, first-use allocations, the first read of the cache
directory's entries; their files were written seconds before, so they come from the page
cache, not a cold disk). The server keeps no answers (`--keep-answers 0`): a kept answer is
work the next request would wait behind, which the first has not. Each phase opens its
connection before its first request. The target: at most 1.5 x in both phases. `--json` for
bench/results_row.py (`first`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from layersplit.runtime.model_store import resolve_model  # noqa: E402
from layersplit.runtime.tokenizer import TextTokenizer  # noqa: E402


def _sibling(name: str):
    """bench/NAME.py as a module (its server runner and streamed chat request)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


agent_session = _sibling("agent_session")
RESTORED = 0.9  # a request whose cached tokens are this share of its prompt or more: restored


def prompts(tok: TextTokenizer, n: int, tokens: int) -> list[list[dict]]:
    """`n` chat conversations of about `tokens` prompt tokens each, no two with a shared
    prefix past the template's first tokens (each system prompt opens with its own line)."""
    return [[{"role": "system",
              "content": f"Session {i}: {'abcdefghij'[i % 10]}{i * 7919 % 1000} is its key.\n"
                         + agent_session.filler(tok, tokens, 17 + i)},
             {"role": "user", "content": "Summarize the notes above in one sentence."}]
            for i in range(n)]


def phase(url: str, model: str, convs: list[list[dict]], new_tokens: int, label: str) -> dict:
    """The conversations one after another on the server at `url` (one kept connection); per
    request its TTFT and cached tokens; the first's TTFT over the median of the rest."""
    out = []
    with httpx.Client() as client:
        client.get(url + "/health", timeout=10)  # (the connection open before the first)
        for i, messages in enumerate(convs):
            r = agent_session.ask(client, url, model, messages, new_tokens,
                                  {"ignore_eos": True})
            out.append({"ttft_ms": r["ttft_s"] * 1e3, "prompt_tokens": r["prompt_tokens"],
                        "cached_tokens": r["cached_tokens"],
                        "decode_tok_s": r["decode_tok_s"]})
            print(f"{label} request {i + 1:2d}: TTFT {out[-1]['ttft_ms']:.1f} ms, prompt "
                  f"{r['prompt_tokens']}, cached {r['cached_tokens']}", flush=True)
    rest = statistics.median(x["ttft_ms"] for x in out[1:])
    return {"phase": label, "requests": out, "first_ms": out[0]["ttft_ms"],
            "rest_median_ms": rest, "ratio": out[0]["ttft_ms"] / rest,
            "prompt_tokens": statistics.median(x["prompt_tokens"] for x in out),
            "restored": all((x["cached_tokens"] or 0) >= RESTORED * x["prompt_tokens"]
                            for x in out)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--requests", type=int, default=11, help="per phase: the first and the "
                                                               "ones it is compared with")
    ap.add_argument("--prompt-tokens", type=int, default=480)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra `layersplit serve` argument (repeatable)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.requests < 2:
        ap.error("--requests: at least 2 (the first and one to compare it with)")
    tok = TextTokenizer.for_model(resolve_model(args.model))
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer: the requests need a chat template")
    convs = prompts(tok, args.requests, args.prompt_tokens)
    ctx = -(-(args.prompt_tokens + args.new_tokens + 256) // 1024) * 1024
    work = Path(tempfile.mkdtemp(prefix="first-request-"))
    try:
        server = agent_session.Served("layersplit", [
            sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", args.model,
            "--devices", args.devices, "--port", "{port}", "--max-context", str(ctx),
            "--kv-cache-dir", str(work / "kv"), "--keep-answers", "0", *args.serve_arg], ROOT,
            work / "serve.log",
            "/health")
        try:
            with httpx.Client() as c:
                model = c.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            fresh = dict(phase(server.url, model, convs, args.new_tokens, "fresh"),
                         ready_s=server.ready_after)
            server.restart()  # (SIGTERM: the saves finish; then until it is ready again)
            restarted = dict(phase(server.url, model, convs, args.new_tokens, "restarted"),
                             ready_s=server.ready_after)
            if not restarted["restored"]:
                print("after the restart not every prompt was restored from the cache (cached "
                      "tokens below 90 % of the prompt): see the requests above", flush=True)
        finally:
            server.stop()
    except BaseException:
        log = work / "serve.log"
        if log.exists():
            print(*log.read_text(errors="replace").splitlines()[-20:], sep="\n")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| phase | ready s | first TTFT ms | median of the next ms | first / next | "
          "cached tokens (first; next) |")
    print("|---|---:|---:|---:|---:|---|")
    for p in (fresh, restarted):
        nxt = sorted({x["cached_tokens"] for x in p["requests"][1:]}, key=str)
        print(f"| {p['phase']} | {p['ready_s']:.1f} | {p['first_ms']:.1f} | "
              f"{p['rest_median_ms']:.1f} | {p['ratio']:.2f} | "
              f"{p['requests'][0]['cached_tokens']}; {', '.join(map(str, nxt))} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "devices": args.devices, "prompt_tokens": args.prompt_tokens,
             "new_tokens": args.new_tokens, "phases": [fresh, restarted]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
