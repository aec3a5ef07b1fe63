"""fla-core's tuned configs (`shards.kernels.fla_loading`): what its autotune chose in one
process, written as fla's config files, is what another process with those files runs, with no
candidate timed, and the layer's outputs are the same bit for bit.

On a CUDA device with fla-core installed (`python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]

# a Qwen3.5 linear-attention layer's prefill chunk (bench/fla_configs.py's `run_layer`), its
# output and states saved; then, in the process that tuned, fla's config files written
RUN = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, {root!r})
    from layersplit.shards.kernels import fla_loading
    from layersplit.shards.layers.gated_delta import GatedDeltaNet
    from pathlib import Path
    fla_loading.CONFIGS = Path({configs!r})
    folder = fla_loading.CONFIGS / fla_loading.gpu_dir_name(torch.cuda.get_device_name(0))
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 4, 8, 128, 128, 4, 1e-6, fused_projections=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    layer = layer.to("cuda", torch.bfloat16)
    x = torch.randn(1, 200, 256, device="cuda", dtype=torch.bfloat16)
    conv = torch.zeros(1, layer.conv_dim, 3, device="cuda", dtype=torch.bfloat16)
    state = torch.zeros(1, 8, 128, 128, device="cuda")
    with torch.no_grad():
        out, _ = layer(x, conv, state, recurrent=False)
    torch.save({{"out": out.cpu(), "state": state.cpu()}}, {saved!r})
    timed = [fla_loading.kernel_name(t) for t in fla_loading._autotuners()
             if getattr(t, "configs_timings", None)]
    files = fla_loading.config_files() if {write!r} else {{}}
    n = fla_loading.write_config_files(files, folder) if files else 0
    print("RESULT", json.dumps({{"timed": timed, "written": sorted(files), "entries": n}}))
""")


def _run(tmp: Path, name: str, env: dict[str, str], write: bool) -> dict:
    code = RUN.format(root=str(ROOT), saved=str(tmp / f"{name}.pt"), write=write,
                      configs=str(tmp / "configs"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLA_")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_configs_written_by_one_process_are_run_by_the_next_untimed(tmp_path):
    tuned = _run(tmp_path, "tuned", {"FLA_CACHE_MODE": "disabled",
                                     "TRITON_CACHE_DIR": str(tmp_path / "t1")}, write=True)
    written = set(tuned["written"])
    assert written and tuned["entries"] >= len(written) and written <= set(tuned["timed"])
    files = list((tmp_path / "configs").glob("*/*.json"))
    assert {f.stem for f in files} == written
    # (as a shard finds them: `fla_loading.CONFIGS`, the user's FLA_* unset)
    env = {"TRITON_CACHE_DIR": str(tmp_path / "t2")}
    shipped = _run(tmp_path, "shipped", env, write=False)
    assert not written & set(shipped["timed"])  # (every kernel written ran its config untimed)
    a, b = torch.load(tmp_path / "tuned.pt"), torch.load(tmp_path / "shipped.pt")
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["state"], b["state"])
