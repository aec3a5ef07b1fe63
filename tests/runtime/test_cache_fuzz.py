"""Damaged prefix-cache files are misses with a log line: never a crash, never a wrong token
(a fixed subset of `tests.fuzz_cache`'s cases; `bench/cache_fuzz.py` runs them all)."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine

from tests.fuzz_cache import GREEDY, CacheFuzzer, mutations
from tests.helpers import run_logged

EVERY = 4  # of the ~200 cases, every 4th (all kinds of damage, both files)


@pytest.mark.slow
def test_damaged_cache_files_are_misses(tiny_llama, tmp_path):
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
    want = run_logged(ref, prompt, GREEDY)
    d = tmp_path / "kv"
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=256, threads=1, kv_cache_dir=str(d))
    with Coordinator(cfg) as c:
        c.generate(prompt, GREEDY)
        c._finish_saves(30)
        files = {p.name: p.read_bytes() for p in d.glob("*.safetensors")}
        assert len(files) == 2
        root = min(files, key=lambda f: len(files[f]) if b'"parent":""' in files[f] else 1e18)
        fuzz = CacheFuzzer(c, d, prompt, want)
        assert fuzz.run("intact", files) == "hit"
        cases = list(mutations(files, root))
        assert len(cases) > 150
        for name, case in cases[::EVERY]:
            fuzz.run(name, case)
        assert fuzz.defects == []
        assert fuzz.outcomes["miss"] > 30
