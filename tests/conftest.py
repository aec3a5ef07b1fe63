"""Shared fixtures: tiny seeded checkpoints (no download) and the default model (fetched once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shards.tiny import FAMILY_CONFIGS, write_tiny_checkpoint

torch.set_num_threads(1)  # shard processes run one thread each in tests: same arithmetic path


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_models(tiny_root) -> dict[str, Path]:
    """family -> HF folder, 6 layers each (splits into 1, 2, 3 shards)."""
    return {
        fam: write_tiny_checkpoint(tiny_root / fam, fam, files=2 if fam == "qwen2" else 1)
        for fam in FAMILY_CONFIGS
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's GGUF, fetched once per machine into $LAYERSPLIT_HOME."""
    from runtime.model_store import fetch_default_model

    return fetch_default_model()


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield


def pytest_report_header(config):
    return f"layersplit tests; LAYERSPLIT_HOME={os.environ.get('LAYERSPLIT_HOME', '~/.cache/layersplit')}"
