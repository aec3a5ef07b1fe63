"""Unit costs of the host calls a cuda-ipc hop makes, on this machine (µs per call, median of
batches): what the hop latency table is made of.

    python bench/cuda_unit_costs.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.ipc.messages import decode, encode, message, segment  # noqa: E402


def per_call_us(fn, n: int = 2000, batches: int = 5) -> float:
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> None:
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    stream = torch.cuda.current_stream(dev)
    ev = torch.cuda.Event(interprocess=True)
    ev.record(stream)
    a = torch.zeros(512, dtype=torch.uint8, device=dev)
    b = torch.zeros(512, dtype=torch.uint8, device="cuda:1" if torch.cuda.device_count() > 1
                    else dev)
    header = message("step", sid=1, seqs=[segment(0, 100, 1, {"temperature": 0.0, "top_k": 0,
                                                             "top_p": 1.0, "seed": 0})], act=None)
    header["act"] = {"dtype": "bfloat16", "shape": [1, 4096]}
    wire = encode(header)
    rows = {
        "python loop (sum of 100 ints)": lambda: sum(range(100)),
        "msgpack encode step header": lambda: encode(header),
        "decode + validate step header": lambda: decode(wire),
        "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "Event.record(stream)": lambda: ev.record(stream),
        "stream.wait_event(event)": lambda: stream.wait_event(ev),
        "torch.cuda.synchronize() idle": lambda: torch.cuda.synchronize(dev),
        "tensor slice + view": lambda: a[0:256].view(torch.bfloat16).view(1, 128),
        "torch copy_ 512 B peer": lambda: b.copy_(a, non_blocking=True),
    }
    try:
        import cupy

        rt = cupy.cuda.runtime
        rows["cupy memcpyAsync 512 B peer"] = lambda: rt.memcpyAsync(
            b.data_ptr(), a.data_ptr(), 512, rt.memcpyDefault, stream.cuda_stream)
        rows["cupy memcpyAsync D2D 512 B peer"] = lambda: rt.memcpyAsync(
            b.data_ptr(), a.data_ptr(), 512, rt.memcpyDeviceToDevice, stream.cuda_stream)
        rows["cupy memcpyPeerAsync 512 B"] = lambda: rt.memcpyPeerAsync(
            b.data_ptr(), b.device.index, a.data_ptr(), a.device.index, 512, stream.cuda_stream)
        rows["cupy eventRecord"] = lambda: rt.eventRecord(ev.cuda_event, stream.cuda_stream)
        rows["cupy streamWaitEvent"] = lambda: rt.streamWaitEvent(stream.cuda_stream,
                                                                   ev.cuda_event, 0)
    except ImportError:
        print("(no CuPy here: its raw-call rows are left out)")
    print(f"{'call':<40} {'us':>8}")
    for name, fn in rows.items():
        us = per_call_us(fn, n=200 if "synchronize" in name or "copy" in name.lower() else 2000)
        torch.cuda.synchronize()
        print(f"{name:<40} {us:>8.2f}")


if __name__ == "__main__":
    main()
