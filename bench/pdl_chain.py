"""What programmatic dependent launch (`shards.kernels.pdl`) saves a decode kernel: chains of
one-row GEMVs (`kernels.gemv`), each reading its own weight (distinct weights, so from HBM, not
L2), and of residual-add + RMSNorm rows (`kernels.row_ops`), captured in one CUDA graph with PDL
off and on (`LAYERSPLIT_PDL`, read as each graph is captured), replayed in turns in one process.

    python bench/pdl_chain.py [--shapes 2048x2048,4096x4096,5632x2048] [--kernels 200]
        [--repeats 5] [--json out.json]

Prints per kernel: µs with PDL off and on, and their ratio (medians of `--repeats` replays,
the two graphs' replays alternating).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.kernels import PDL_SWITCH, pdl_enabled  # noqa: E402
from layersplit.shards.kernels.gemv import gemv  # noqa: E402
from layersplit.shards.kernels.row_ops import add_rms_norm  # noqa: E402


def _capture(step, pdl: bool) -> torch.cuda.CUDAGraph:
    os.environ[PDL_SWITCH] = "1" if pdl else "0"
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def measure(name: str, step, kernels: int, repeats: int) -> dict:
    graphs = {False: _capture(step, False), True: _capture(step, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for pdl in ((False, True) if r % 2 == 0 else (True, False)):
            times[pdl].append(_replay_us(graphs[pdl]) / kernels)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    row = {"chain": name, "kernels": kernels, "us_off": round(off, 3), "us_on": round(on, 3),
           "on_over_off": round(on / off, 4)}
    print(f"{name:>22}: {off:7.3f} us a kernel off, {on:7.3f} on ({on / off:.3f})", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2048x2048,4096x4096,5632x2048,12288x4096")
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    os.environ[PDL_SWITCH] = "1"
    if not pdl_enabled(dev):
        sys.exit(f"PDL does not run on {dev} here (needs compute capability 9.0 and a Triton "
                 f"that launches with it): nothing to compare")
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            count = args.kernels
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
                  for _ in range(count)]
            x0 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

            def chain(ws=ws, x0=x0, n=n, k=k) -> None:
                x = x0
                for w in ws:
                    y = gemv(x, w)
                    x = y if n == k else x0  # (another width: each reads the first row)
            rows.append(measure(f"gemv {shape}", chain, count, args.repeats))
            del ws
        hid = 4096
        h = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
        nw = torch.ones(hid, device=dev, dtype=torch.bfloat16)

        def norms() -> None:
            a, b = h, x
            for _ in range(args.kernels):
                a, b = add_rms_norm(a, b, nw, 1e-6)
        rows.append(measure(f"add_rms_norm {hid}", norms, args.kernels, args.repeats))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
