"""`layersplit generate` is one request from a terminal: its process (the coordinator) imports
nothing of the HTTP server's stack, nor torch or transformers (only the shards need torch), so
that none of it is on the way to the first token. Checked on a real run, in a process of its
own, after the command has returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("fastapi", "uvicorn", "starlette", "pydantic", "openai", "transformers", "torch",
         "layersplit.runtime.server", "layersplit.runtime.openai_api")


@pytest.mark.slow
def test_generate_imports_no_server_stack(tiny_llama):
    code = ("import json, sys\n"
            "from layersplit.launch.cli import main\n"
            f"rc = main(['generate', 'the cat sat', '--chat', '--model', {str(tiny_llama)!r}, "
            "'--devices', 'cpu', '--threads', '1', '--max-tokens', '2', '--draft', 'none', "
            "'--json'])\n"
            f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
            "print(json.dumps({'rc': rc, 'heavy': heavy}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, out.stderr[-2000:]
    assert got["heavy"] == [], f"layersplit generate imported {got['heavy']}"
