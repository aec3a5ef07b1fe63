"""Run a command and print each line it writes, stdout and stderr, with the seconds since it
started: where a cold start's time goes, read off the runtime's own log lines.

    python bench/startup_trace.py layersplit generate --token-ids 5,6,7 \
        --model random:smollm2-135m-shape --devices cuda:0 --max-tokens 64 --json

With `generate --json` its last line says when the first token came, counted from the command's
start: the JSON line's time less the decode time of the tokens after the first
(`first token at S s`).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time


def main() -> int:
    t0 = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

    first: list[float] = []

    def pump(stream, tag: str) -> None:
        for line in stream:
            now = time.perf_counter() - t0
            print(f"{now:7.2f} {tag} {line.rstrip()[:240]}", flush=True)
            if tag == "out" and line.startswith("{"):
                first.append(first_token_at(now, line))

    threads = [threading.Thread(target=pump, args=(proc.stdout, "out")),
               threading.Thread(target=pump, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join()
    print(f"{time.perf_counter() - t0:7.2f} exit {rc}")
    for t in first:
        if not math.isnan(t):
            print(f"first token at {t:.2f} s")
    return rc


def first_token_at(printed_at: float, line: str) -> float:
    """When the first token of `generate --json`'s result came: NaN if the line says nothing."""
    try:
        r = json.loads(line)
        return printed_at - (len(r["tokens"]) - 1) / r["decode_tok_s"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return float("nan")


if __name__ == "__main__":
    sys.exit(main())
