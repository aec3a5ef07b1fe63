"""The outside implementations `layersplit check` compares us with: transformers (float32, the
same weights) and llama.cpp (llama-cpp-python, the same GGUF file).

Each writes, for every prompt, its greedy continuation and the logits every token of it was
drawn from; the runtime is then fed the very same tokens (`runtime.check`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from layersplit.runtime.parity import Agreement

log = logging.getLogger(__name__)

REFERENCES = ("transformers", "llama.cpp")
INSTALL = {
    "transformers": "pip install 'layersplit[check]' (transformers, and accelerate for GGUF)",
    "llama.cpp": "pip install llama-cpp-python (CMAKE_ARGS='-DGGML_CUDA=on' for GPUs)",
}


class ReferenceUnavailable(RuntimeError):
    """The reference cannot run here: not installed, or it cannot read this checkpoint."""


@dataclasses.dataclass(slots=True)
class ReferenceRun:
    prompt: list[int]
    tokens: list[int]  # the reference's greedy continuation (a stop token ends it, included)
    logits: np.ndarray  # float32 (len(tokens), vocab): row i is what tokens[i] was drawn from


# one greedy step: (tokens to feed, whether they start a new sequence) -> last row's logits
StepFn = Callable[[list[int], bool], np.ndarray]


def greedy_continuation(step: StepFn, prompt: Sequence[int], new_tokens: int,
                        stop_ids: Sequence[int]) -> ReferenceRun:
    rows, tokens = [], []
    logits = step(list(prompt), True)
    for _ in range(new_tokens):
        rows.append(logits)
        tok = int(np.argmax(logits))
        tokens.append(tok)
        if tok in stop_ids or len(tokens) == new_tokens:
            break
        logits = step([tok], False)
    return ReferenceRun(list(prompt), tokens, np.stack(rows).astype(np.float32))


def run_reference(kind: str, model: str | Path, prompts: Sequence[Sequence[int]],
                  new_tokens: int, stop_ids: Sequence[int], device: str,
                  random_seed: int = 0, progress: Callable[[int], None] | None = None,
                  ) -> list[ReferenceRun]:
    """`kind`'s greedy continuations of `prompts` (its model freed before returning)."""
    if kind == "transformers":
        step, close = _transformers(model, device, random_seed)
    elif kind == "llama.cpp":
        step, close = _llama_cpp(model, device, max(len(p) for p in prompts) + new_tokens)
    else:
        raise ReferenceUnavailable(f"reference {kind!r}: use one of {', '.join(REFERENCES)}")
    try:
        out = []
        for i, p in enumerate(prompts):
            out.append(greedy_continuation(step, p, new_tokens, stop_ids))
            if progress is not None:
                progress(i + 1)
        return out
    finally:
        close()


def _require(kind: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ReferenceUnavailable(f"the {kind} reference needs the {module} package, which is "
                                   f"not installed here ({e}): {INSTALL[kind]}") from None


def load_transformers(model: str | Path, device: str, dtype: str = "float32",
                      random_seed: int = 0):
    """A transformers CausalLM of `model` (an HF folder, a GGUF file through transformers' own
    reader, or `random:NAME`: the runtime's seeded tensors, dense families) in `dtype`."""
    _require("transformers", "torch")
    transformers = _require("transformers", "transformers")
    from layersplit.shards.checkpoint import RANDOM_PREFIX
    from layersplit.shards.dtypes import torch_dtype

    spec = str(model)
    if spec.startswith(RANDOM_PREFIX):
        # the runtime's own seeded tensors in a transformers model (dense families)
        from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
        from layersplit.shards.hf_convert import hf_causal_lm

        ckpt = open_checkpoint(spec, random_seed)
        try:
            whole = load_layer_range(ckpt, 0, ckpt.config.num_layers, torch_dtype(dtype), device)
            hf = hf_causal_lm(whole, device, torch_dtype(dtype),
                              ckpt.config.max_position_embeddings)
        except ValueError as e:
            raise ReferenceUnavailable(f"{spec}: {e}; write the weights to an HF folder "
                                       "(bench/parity.py --write DIR) and check that") from None
    else:
        p = Path(spec).expanduser()
        kwargs = {"dtype": torch_dtype(dtype)}
        if p.suffix == ".gguf":  # transformers' own GGUF reader, not ours
            kwargs["gguf_file"] = p.name
            p = p.parent
        elif _is_fp8(p):  # (on GPUs that run FP8, transformers would quantize activations
            # too: the reference is the dequantized weights', as ours is)
            kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
        except Exception as e:  # noqa: BLE001 - named: which checkpoint, and why
            raise ReferenceUnavailable(f"transformers cannot load {spec}: {e}") from None
        hf = hf.to(device)
    _torch_paths(hf)
    return hf.eval()


# the functions a transformers modeling module takes from a kernel package where one is installed
# (fla's gated delta rule, causal-conv1d): the runtime runs those same kernels, so a reference
# through them would share their errors
KERNEL_PACKAGE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                            "causal_conv1d_fn", "causal_conv1d_update")


def _torch_paths(hf) -> None:
    """Point `hf`'s modeling module back at transformers' own torch code for each of
    `KERNEL_PACKAGE_FUNCTIONS` it took from a kernel package (its wrapper keeps the torch
    function as `__wrapped__`): the reference is then transformers' arithmetic alone, and no
    Triton kernel of the package compiles or autotunes in the reference's process."""
    import sys

    module = sys.modules.get(type(hf).__module__)
    for name in KERNEL_PACKAGE_FUNCTIONS:
        fn = getattr(module, name, None)
        own = getattr(fn, "__wrapped__", None)
        if own is not None:
            setattr(module, name, own)
            log.info("reference: transformers' own %s, not a kernel package's", name)


def _is_fp8(folder: Path) -> bool:
    """Whether an HF folder's config.json says its weights are FP8 (`shards.fp8`)."""
    try:
        q = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def _transformers(model: str | Path, device: str, random_seed: int):
    torch = _require("transformers", "torch")
    hf = load_transformers(model, device, "float32", random_seed)
    past: list = [None]

    def step(tokens: list[int], new: bool) -> np.ndarray:
        x = torch.tensor([tokens], dtype=torch.long, device=device)
        with torch.no_grad():
            out = hf(input_ids=x, past_key_values=None if new else past[0], use_cache=True)
        past[0] = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    def close() -> None:
        past[0] = None
        if str(device).startswith("cuda"):
            hf.to("cpu")
            torch.cuda.empty_cache()

    return step, close


def _llama_cpp(model: str | Path, device: str, context: int):
    llama_cpp = _require("llama.cpp", "llama_cpp")
    if Path(model).suffix != ".gguf":
        raise ReferenceUnavailable(f"the llama.cpp reference reads GGUF files; {model} is not one")
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=max(context, 512), logits_all=True,
                          n_gpu_layers=-1 if str(device).startswith("cuda") else 0,
                          n_batch=512, verbose=False)

    def step(tokens: list[int], new: bool) -> np.ndarray:
        if new:
            llm.reset()
        llm.eval(tokens)
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

    return step, llm.close


def half_agreement(model: str | Path, refs: list[ReferenceRun], dtype: str, device: str,
                   new_tokens: int, stop_ids: Sequence[int], stepwise: bool = True) -> dict:
    """transformers in `dtype` against its own float32 run (`refs`): teacher-forced on the
    float32 tokens, the whole sequence in one forward and (`stepwise`) as our check feeds the
    runtime, the prompt's prefill and then one token a step on its KV cache; and free-running.
    (Each way rounds its own way; `stepwise` is the one shaped like ours. It costs a forward per
    token: `stepwise=False` leaves it out where only the free-running count is wanted.)"""
    torch = _require("transformers", "torch")
    hf = load_transformers(model, device, dtype)
    agree, equal = Agreement(), 0
    past: list = [None]

    def step(tokens: list[int], new: bool) -> np.ndarray:
        x = torch.tensor([tokens], device=device)
        with torch.no_grad():
            out = hf(input_ids=x, past_key_values=None if new else past[0], use_cache=True)
        past[0] = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    by_step = Agreement()
    for ref in refs:
        ids = torch.tensor([ref.prompt + ref.tokens[:-1]], device=device)
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, len(ref.prompt) - 1:].float().cpu().numpy()
        agree.add(ref.logits, logits)
        if stepwise:
            rows = [step(list(ref.prompt), True)] + [step([t], False) for t in ref.tokens[:-1]]
            by_step.add(ref.logits, np.stack(rows).astype(np.float32))
        free = greedy_continuation(step, ref.prompt, new_tokens, stop_ids)
        equal += free.tokens == ref.tokens
    past[0] = None
    hf = None  # (freed before the next model loads)
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return {"who": f"transformers {dtype}", **agree.to_json(),
            **({"stepwise": by_step.to_json()} if stepwise else {}),
            "greedy_equal": equal, "prompts": len(refs)}
