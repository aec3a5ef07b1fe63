"""Run a command and print each line it writes, stdout and stderr, with the seconds since it
started: where a cold start's time goes, read off the runtime's own log lines.

    python bench/startup_trace.py layersplit generate --token-ids 5,6,7 \
        --model random:smollm2-135m-shape --devices cuda:0 --max-tokens 64 --json
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def main() -> int:
    t0 = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

    def pump(stream, tag: str) -> None:
        for line in stream:
            print(f"{time.perf_counter() - t0:7.2f} {tag} {line.rstrip()[:240]}", flush=True)

    threads = [threading.Thread(target=pump, args=(proc.stdout, "out")),
               threading.Thread(target=pump, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join()
    print(f"{time.perf_counter() - t0:7.2f} exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
