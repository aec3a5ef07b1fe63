"""A conversation's cached turns on CPU shards: a cold prompt, then prompts growing by `--new`
tokens, each restored from the RAM tier; per turn, the time to the first token split into its
restore and its prefill (`Progress.marks`, the phases of the server's TTFT) and the snapshots
taken after the first token. With `--turn-ends` every prompt ends as a chat turn does (an
end-of-turn token, then 3 tokens), so its last cut, a cache point, lies inside it.

    python bench/cached_turns.py --shards 2 --first 16384 --new 256 --turns 4 --turn-ends

The model is a seeded random tiny Llama (`shards.tiny`, `--layers` layers) written once under
the system's temporary folder.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.generate import Progress, collect
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint

EOS = 2  # the tiny models' end-of-turn token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=2, help="CPU shards")
    ap.add_argument("--layers", type=int, default=12, help="layers of the tiny model")
    ap.add_argument("--first", type=int, default=8192, help="tokens of the cold first turn")
    ap.add_argument("--new", type=int, default=256, help="tokens each later turn adds")
    ap.add_argument("--turns", type=int, default=4, help="cached turns after the first")
    ap.add_argument("--chunk", type=int, default=512, help="prefill_chunk")
    ap.add_argument("--turn-ends", action="store_true",
                    help="end every prompt with an end-of-turn token and 3 more tokens")
    a = ap.parse_args()
    model = Path(tempfile.gettempdir()) / f"layersplit-bench-tiny{a.layers}"
    if not (model / "config.json").exists():
        write_tiny_checkpoint(model, "llama", num_layers=a.layers,
                              max_position_embeddings=65536)
    total = a.first + a.new * a.turns
    rng = random.Random(0)
    toks = [rng.randrange(EOS + 1, 320) for _ in range(total)]
    if a.turn_ends:
        for t in range(a.turns + 1):
            toks[a.first + a.new * t - 4] = EOS
    cfg = RuntimeConfig(model=str(model), devices=("cpu",) * a.shards, prefill_chunk=a.chunk,
                        max_context=total + 64, threads=1, max_seqs=2, draft="none")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    restores, prefills = [], []
    with Coordinator(cfg) as c:
        for t in range(a.turns + 1):
            n = a.first + a.new * t
            p = Progress()
            collect(c.stream(toks[:n], params, p), p, n)
            m = p.marks
            restore = m["restored"] - m["admitted"]
            prefill = p.first_token_at - m["restored"]
            if t:
                restores.append(restore)
                prefills.append(prefill)
            snaps = ("n/a" if "cached" not in m
                     else f"{(m['cached'] - p.first_token_at) * 1e3:.1f} ms")
            print(f"shards {a.shards} turn {t}: prompt {n} cached {p.cached_tokens} "
                  f"({p.cache_tier}): restore {restore * 1e3:.1f} ms, prefill "
                  f"{prefill * 1e3:.1f} ms ({n - p.cached_tokens} new), snapshots after the "
                  f"first token {snaps}", flush=True)
        st = c.cache.stats
        print(f"shards {a.shards}: {st.hits_ram} RAM hits, {st.hits_resident} of them served "
              "from blocks still in the KV pool (no copy)")
    print(f"shards {a.shards} cached turns, median: restore "
          f"{statistics.median(restores) * 1e3:.1f} ms, prefill "
          f"{statistics.median(prefills) * 1e3:.1f} ms ({time.strftime('%Y-%m-%d')})")


if __name__ == "__main__":
    main()
