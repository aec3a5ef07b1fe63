"""Campaign: prefix-cache files damaged every way `tests/fuzz_cache.py` knows (truncation at every
field boundary, bit flips in header, tokens, checksums and payload, lying headers, another
model's file) plus random bit flips, each read back by a real 2-shard CPU runtime of a tiny
seeded model. Prints the outcome counts; any crash, wrong token or silent miss is listed.

    python bench/cache_fuzz.py --flips 100

Exit status 1 if there is any defect.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.reference import ReferenceEngine  # noqa: E402
from layersplit.shards.tiny import write_tiny_checkpoint  # noqa: E402

from tests.fuzz_cache import GREEDY, CacheFuzzer, mutations  # noqa: E402
from tests.helpers import run_logged  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flips", type=int, default=100, help="random bit flips per file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "llama", "llama")
        ref = ReferenceEngine(model, prefill_chunk=16, max_context=256)
        prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
        want = run_logged(ref, prompt, GREEDY)
        d = Path(tmp) / "kv"
        cfg = RuntimeConfig(model=str(model), devices=("cpu", "cpu"), prefill_chunk=16,
                            max_context=256, threads=1, kv_cache_dir=str(d))
        t0 = time.perf_counter()
        with Coordinator(cfg) as c:
            c.generate(prompt, GREEDY)
            c._finish_saves(30)
            files = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}
            root = next(f for f, b in files.items() if b'"parent":""' in b)
            fuzz = CacheFuzzer(c, d, prompt, want)
            cases = list(mutations(files, root, flips=args.flips, seed=args.seed))
            for name, case in cases:
                fuzz.run(name, case)
        took = time.perf_counter() - t0
    print(f"{len(cases)} damaged cache directories ({len(files)} entry files, {args.flips} "
          f"random flips each) in {took:.0f} s")
    for outcome in ("hit", "miss", "silent_miss", "wrong", "crash"):
        print(f"  {outcome:12s} {fuzz.outcomes[outcome]}")
    for d in fuzz.defects:
        print("DEFECT", d)
    return 1 if fuzz.defects else 0


if __name__ == "__main__":
    raise SystemExit(main())
