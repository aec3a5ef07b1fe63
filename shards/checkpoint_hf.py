"""Hugging Face model folders: config.json plus single or sharded *.safetensors.

Only the tensors a layer range needs are read (safetensors files are memory-mapped). A gpt-oss
checkpoint whose `quantization_config` says `mxfp4` stores its experts as MXFP4 blocks and
scales (`NAME_blocks`, `NAME_scales`); an FP8 one (`quant_method = "fp8"`) its linears' weights
in float8 with block scales (`NAME_scale_inv`, `shards.fp8`); a GPTQ or AWQ one its linears as
packed int4 values, zeros and scales (`X.qweight`, `X.qzeros`, `X.scales`, `shards.int4`). All are
dequantized at load, with a warning that says what that costs in memory; under `weight_format =
"quantized"` the FP8 and int4 projections are kept as stored instead (`load_blocks`,
`shards.quant_load`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from layersplit.shards.errors import CheckpointError
from layersplit.shards.fp8 import (
    SCALE_SUFFIX,
    Fp8Scheme,
    Fp8Weight,
    dequantize_fp8,
    keeps,
    scale_shape,
)
from layersplit.shards.gpt_oss_config import is_mxfp4
from layersplit.shards.int4 import (
    Int4Scheme,
    Int4Weight,
    check_parts,
    dequantize_int4,
    part_shapes,
    repack_int4,
)
from layersplit.shards.model_config import ModelConfig, read_hf_config
from layersplit.shards.mxfp4 import dequantize_mxfp4
from layersplit.shards.quant_config import quant_scheme
from safetensors import safe_open

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied where it lies in host memory at an address that is not a multiple of 64
    bytes (a tensor read in place from a safetensors file sits at its offset in the file): CPU
    matmul kernels take other paths, summing in another order, on unaligned operands, so a
    weight's arithmetic would turn on where its file put it, not on its values."""
    if t.device.type == "cpu" and t.data_ptr() % 64:
        return t.clone()
    return t


def _open(path: Path, framework: str = "pt"):
    """`framework` "numpy" to read names only: "pt" imports torch (the coordinator reads the
    names, never the tensors)."""
    try:
        return safe_open(str(path), framework=framework)
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def _check_fp8(path: Path, src: str, w: torch.Tensor, scale: torch.Tensor) -> None:
    import torch
    if not scale.dtype.is_floating_point:
        raise CheckpointError(f"{path}: {src + SCALE_SUFFIX!r} is stored as {scale.dtype}; FP8 "
                              "block scales must be floats")
    if w.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{path}: {src!r} has a {src + SCALE_SUFFIX!r} beside it but is "
                              f"stored as {w.dtype}, not float8_e4m3fn")


class HFCheckpoint:
    """A Hugging Face folder. `load` reads canonical tensor names, one file at a time."""

    def __init__(self, folder: Path, strict: bool = True, config: ModelConfig | None = None
                 ) -> None:
        """`strict`: see `config_from_hf` (False for a draft's folder only); `config`: the
        shape, read elsewhere (a DFlash draft's layers, `draft.dflash`)."""
        self.path = folder
        self.config: ModelConfig = config or read_hf_config(folder, strict)
        self.weight_map = self._weight_map()
        # (the config was read above; a gpt_oss one may say its experts are MXFP4, another
        # that its linears are FP8 or int4)
        raw = json.loads((folder / "config.json").read_text())
        self.mxfp4 = self.config.gpt_oss is not None and is_mxfp4(raw)
        scheme = None if self.config.gpt_oss is not None else quant_scheme(raw, folder)
        self.fp8 = scheme if isinstance(scheme, Fp8Scheme) else None
        self.int4 = scheme if isinstance(scheme, Int4Scheme) else None

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from e
            return {str(k): str(v) for k, v in wm.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        wm: dict[str, str] = {}
        for f in files:
            with _open(f, "numpy") as st:
                for k in st.keys():
                    wm[k] = f.name
        return wm

    @property
    def keeps_quantized(self) -> bool:
        """Whether `weight_format = "quantized"` keeps some of its weights as stored (FP8,
        int4)."""
        return self.fp8 is not None or self.int4 is not None

    def kept_type(self, source: str) -> str | None:
        """"FP8" ("INT4") for a projection's weight stored in FP8 (GPTQ / AWQ int4), kept as
        such under `weight_format = "quantized"` (`layers.fp8_linear`, `layers.int4_linear`),
        else None (an embedding is dequantized at load)."""
        if self.int4 is not None:
            return "INT4" if keeps(source) and self._int4(source) else None
        if self.fp8 is None:
            raise CheckpointError(
                f"{self.path}: weight_format = \"quantized\" keeps a GGUF file's blocks or an "
                "FP8, GPTQ or AWQ checkpoint's values; this checkpoint has none of them (use "
                "weight_format = \"auto\" or \"dequantize\")")
        return "FP8" if keeps(source) and source + SCALE_SUFFIX in self.weight_map else None

    def load_blocks(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                    device: torch.device | str = "cpu") -> dict[str, Fp8Weight | Int4Weight]:
        """The kept FP8 tensors as stored: values and block scales; the kept int4 ones repacked
        into the layout the device keeps (`int4.repack_int4`) (`kept_type`)."""
        if self.int4 is not None:
            return {name: repack_int4(self.int4, self._read_int4(src, shapes[name], device),
                                      src.removesuffix(".weight"))
                    for name, src in sources.items()}
        return {name: self._read_fp8(src, shapes[name], device) for name, src in sources.items()}

    def _read_fp8(self, src: str, shape: tuple[int, ...],
                  device: torch.device | str) -> Fp8Weight:
        """An FP8 tensor as stored, with its block scales (as float32), checked."""
        import torch
        part_shapes = {src: shape, src + SCALE_SUFFIX: scale_shape(shape, self.fp8.block)}
        parts = self._read(part_shapes, {k: k for k in part_shapes}, None, device)
        w, scale = parts[src], parts[src + SCALE_SUFFIX]
        _check_fp8(self.path, src, w, scale)
        return Fp8Weight(w, scale.to(torch.float32), self.fp8.block)

    def has(self, name: str) -> bool:
        return name in self.weight_map or self._packed(name) or self._int4(name)

    def _int4(self, name: str) -> bool:
        """Whether the weight `name` (`X.weight`) is stored as int4 parts (`X.qweight`, ...)."""
        return self.int4 is not None and name.endswith(".weight") and \
            name.removesuffix("weight") + "qweight" in self.weight_map

    def _packed(self, name: str) -> bool:
        """Whether `name` is stored as MXFP4 blocks and scales."""
        return self.mxfp4 and f"{name}_blocks" in self.weight_map and \
            f"{name}_scales" in self.weight_map

    def load(
        self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Read each canonical name from its source tensor, checking shape; one pass per file.
        MXFP4 tensors are read as their blocks and scales, FP8 ones with their scales, and
        dequantized to `dtype`."""
        packed = {n: s for n, s in sources.items()
                  if s not in self.weight_map and self._packed(s)}
        fp8 = {n: s for n, s in sources.items()
               if self.fp8 is not None and s + SCALE_SUFFIX in self.weight_map}
        int4 = {n: s for n, s in sources.items() if self._int4(s)}
        out = self._read(shapes, {n: s for n, s in sources.items()
                                  if n not in packed and n not in fp8 and n not in int4},
                         dtype, device)
        if fp8:
            out.update(self._load_fp8(shapes, fp8, dtype, device))
        if int4:
            out.update(self._load_int4(shapes, int4, dtype, device))
        if not packed:
            return out
        stored = made = 0
        for name, src in packed.items():
            e, cols, rows = shapes[name]
            if cols % 32:
                raise CheckpointError(f"{self.path}: {src!r} is MXFP4 but its {cols} columns "
                                      "are not blocks of 32")
            part_shapes = {f"{src}_blocks": (e, rows, cols // 32, 16),
                           f"{src}_scales": (e, rows, cols // 32)}
            parts = self._read(part_shapes, {k: k for k in part_shapes}, None, device)
            out[name] = dequantize_mxfp4(parts[f"{src}_blocks"], parts[f"{src}_scales"], dtype)
            stored += sum(t.numel() for t in parts.values())
            made += out[name].numel() * out[name].element_size()
        log.warning("%s: %d MXFP4 expert tensors dequantized at load to %s: %.1f MB stored take "
                    "%.1f MB of memory (%.1f x); kept-quantized MXFP4 weights are not "
                    "implemented", self.path.name, len(packed), str(dtype).removeprefix("torch."),
                    stored / 1e6, made / 1e6, made / max(stored, 1))
        return out

    def _load_fp8(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                  dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """`load` of FP8 weights: each read with its block scales, dequantized to `dtype`."""
        out, stored = {}, 0
        for name, src in sources.items():  # (one at a time: a tensor's FP8 bytes are freed
            # before the next is read)
            f = self._read_fp8(src, shapes[name], device)
            out[name] = dequantize_fp8(f.values, f.scale, f.block, dtype)
            stored += f.values.numel() + 4 * f.scale.numel()
            del f
        made = sum(t.numel() * t.element_size() for t in out.values())
        log.warning("%s: %d FP8 tensors dequantized at load to %s: %.1f MB stored take %.1f MB "
                    "of memory (%.1f x); weight_format = quantized keeps the projections a layer "
                    "reads through its modules in FP8",
                    self.path.name, len(out), str(dtype).removeprefix("torch."), stored / 1e6,
                    made / 1e6, made / max(stored, 1))
        return out

    def _read_int4(self, src: str, shape: tuple[int, ...],
                   device: torch.device | str) -> dict[str, torch.Tensor]:
        """The stored parts (`X.qweight`, ...) of the int4 weight `src` (`X.weight`), checked."""
        prefix, scheme = src.removesuffix(".weight"), self.int4
        try:
            want = part_shapes(scheme, prefix, shape)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        g_idx = prefix + ".g_idx"
        if g_idx in want and g_idx not in self.weight_map and not scheme.desc_act:
            del want[g_idx]  # (groups of consecutive rows; under desc_act it is needed)
        parts = self._read(want, {k: k for k in want}, None, device)
        try:
            check_parts(scheme, prefix, parts)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        return parts

    def _load_int4(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                   dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """`load` of GPTQ / AWQ weights: each read as its packed parts, dequantized to
        `dtype` (`shards.int4`)."""
        out, stored, scheme = {}, 0, self.int4
        for name, src in sources.items():  # (one at a time, as `_load_fp8`)
            parts = self._read_int4(src, shapes[name], device)
            out[name] = dequantize_int4(scheme, parts, src.removesuffix(".weight"), dtype)
            stored += sum(t.numel() * t.element_size() for t in parts.values())
            del parts
        made = sum(t.numel() * t.element_size() for t in out.values())
        log.warning("%s: %d %s int4 tensors dequantized at load to %s: %.1f MB stored take "
                    "%.1f MB of memory (%.1f x); weight_format = quantized keeps the projections "
                    "a layer reads through its modules in int4", self.path.name, len(out),
                    scheme.method.upper(), str(dtype).removeprefix("torch."), stored / 1e6,
                    made / 1e6, made / max(stored, 1))
        return out

    def _read(
        self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
        dtype: torch.dtype | None, device: torch.device | str,
    ) -> dict[str, torch.Tensor]:
        """`load` of stored tensors (None: in their stored dtype)."""
        by_file: dict[str, list[str]] = {}
        for name, src in sources.items():
            if src not in self.weight_map:
                packed = src.removesuffix("weight") + "qweight" in self.weight_map
                raise CheckpointError(
                    f"{self.path}: tensor {src!r} is missing (needed for {name!r})" +
                    (f"; {src.removesuffix('weight') + 'qweight'!r} is int4 but config.json has "
                     "no quantization_config with quant_method 'gptq' or 'awq'"
                     if packed and self.int4 is None else ""))
            by_file.setdefault(self.weight_map[src], []).append(name)
        out: dict[str, torch.Tensor] = {}
        cache: dict[str, torch.Tensor] = {}
        for fname, names in by_file.items():
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: listed in the index but missing")
            with _open(fpath) as st:
                for name in names:
                    src = sources[name]
                    if src not in cache:
                        try:
                            t = st.get_tensor(src)
                        except Exception as e:
                            raise CheckpointError(
                                f"{fpath}: cannot read tensor {src!r}: {e}") from e
                        if tuple(t.shape) != shapes[name]:
                            raise CheckpointError(
                                f"{fpath}: tensor {src!r} has shape {tuple(t.shape)}, "
                                f"expected {shapes[name]} from config.json"
                            )
                        if dtype is not None and t.dtype.is_floating_point and \
                                t.element_size() == 1:  # (a value off by its block's scale)
                            raise CheckpointError(
                                f"{fpath}: tensor {src!r} is stored as {t.dtype}, "
                                + (f"without a {src + SCALE_SUFFIX!r} beside it" if self.fp8
                                   else "but config.json has no quantization_config with "
                                   "quant_method 'fp8'"))
                        cache[src] = aligned(t.to(device=device, dtype=dtype or t.dtype))
                    out[name] = cache[src]
        return out
