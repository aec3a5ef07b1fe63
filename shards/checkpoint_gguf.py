"""GGUF files (llama.cpp): architecture from the header, tensors dequantized to the run dtype,
or the linear layers' weights kept in their blocks (`load_blocks`, `shards.quant_blocks`).

llama.cpp stores the rows of `attn_q` / `attn_k` of llama-architecture models permuted for its
rotary layout; `load` undoes that per head so the HF-style rotary in `shards.model` applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from layersplit.shards.errors import CheckpointError
from layersplit.shards.gguf_header import read_header
from layersplit.shards.gguf_hybrid import (
    HYBRID_ARCHITECTURES,
    gguf_tensor_name,
    hybrid_config,
    tensor_source,
)
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.quant_blocks import KEPT_TYPES

if TYPE_CHECKING:
    import torch

try:
    import gguf
    from gguf.quants import dequantize
except ImportError as e:  # pragma: no cover - gguf is a hard dependency
    raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
     Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
# GGUF architecture -> HF model_type; only llama permutes q/k rows.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "qwen2moe": "qwen2_moe"}  # llama with `expert_count`: Mixtral
# hybrid (linear-attention) architectures: `shards.gguf_hybrid`

_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the experts stacked in 3-D tensors (`shards.weights.moe_tensor_shapes`)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# whether an arch renormalises the top-k router weights when `expert_weights_norm` is absent
# (llama.cpp: Mixtral and Qwen3-MoE do, Qwen2-MoE does not)
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TO_GGUF_LAYER = {v: k for k, v in _PER_LAYER.items()}
_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL.items()}

# values `GGUFFile._read_on` dequantizes at a time (64 MB of float32 work on the device)
DEQUANT_CHUNK_VALUES = 1 << 24


def gguf_name(canonical: str) -> str:
    """Canonical HF tensor name -> GGUF tensor name."""
    if canonical in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[canonical]
    parts = canonical.split(".", 3)  # model, layers, idx, rest
    return f"blk.{parts[2]}.{_TO_GGUF_LAYER[parts[3]]}"


def unpermute_rows(w: Any, heads: int) -> Any:
    """Undo llama.cpp's per-head rotary row permutation of attn_q / attn_k (of a numpy array
    or a torch tensor)."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """The permutation llama.cpp's converter applies (inverse of `unpermute_rows`)."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, 2, d, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """A tensor's stored bytes as float32: the block types `quant_blocks` keeps in torch (its
    `dequantize_rows`: gguf's float32 operations in gguf's order, bit for bit, on every core;
    ~6x faster than gguf's numpy, which runs row group by row group on one core), the others
    by `gguf.quants.dequantize`."""
    if qtype.name not in KEPT_TYPES:
        return dequantize(raw, qtype)
    import torch
    from layersplit.shards.quant_blocks import dequantize_rows

    rows = torch.from_numpy(np.array(raw, copy=True))  # (the map is read-only)
    return dequantize_rows(rows, qtype.name).numpy()


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = read_header(path)
        self.tensors = self.header.tensors
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES and arch not in HYBRID_ARCHITECTURES:
            raise CheckpointError(
                f"{path}: general.architecture={arch!r} is not supported "
                f"(supported: {', '.join([*ARCHITECTURES, *HYBRID_ARCHITECTURES])})"
            )
        self.arch = arch
        self.hybrid = arch in HYBRID_ARCHITECTURES
        if "rope_freqs.weight" in self.tensors:  # llama.cpp's form of llama3 rope scaling
            raise CheckpointError(
                f"{path}: tensor 'rope_freqs.weight' (per-frequency rope factors, llama.cpp's "
                "form of Llama 3.1+ rope scaling) is not supported; reading the file without "
                "it would give wrong logits past the original context: use the model's Hugging "
                "Face folder instead")
        self.config = hybrid_config(self) if self.hybrid else self._config()

    def field(self, key: str, default: Any = ...) -> Any:
        if key not in self.header.fields:
            if default is ...:
                raise CheckpointError(f"{self.path}: required GGUF field {key!r} is missing")
            return default
        return self.header.fields[key]

    def _config(self) -> ModelConfig:
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        head_dim = int(self.field(f"{a}.attention.key_length", 0) or hidden // heads)
        tok_embd = self.tensors.get("token_embd.weight")
        vocab = self.field(f"{a}.vocab_size", None)
        if vocab is None:
            if tok_embd is None:
                raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' is missing")
            vocab = int(tok_embd.shape[-1])
        rope: dict[str, Any] = {}
        scaling = self.field(f"{a}.rope.scaling.type", None)
        if scaling == "linear":
            rope = {"rope_type": "linear", "factor": float(self.field(f"{a}.rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise CheckpointError(f"{self.path}: {a}.rope.scaling.type={scaling!r} is not "
                                  "supported")
        eos = self.field("tokenizer.ggml.eos_token_id", None)
        blocks = int(self.field(f"{a}.block_count"))
        window = self.field(f"{a}.attention.sliding_window", None)
        windows = {} if not window else {  # every layer, as transformers' Mistral
            "layer_types": ("sliding_attention",) * blocks, "sliding_window": int(window)}
        moe = self._moe_fields(blocks)
        model_type = ARCHITECTURES[a]
        if a == "llama" and moe:
            model_type = "mixtral"
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_layers=blocks,
            num_heads=heads,
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            rope_scaling=tuple(sorted(rope.items())),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (int(eos),),
            **windows,
            **moe,
        )

    def _moe_fields(self, blocks: int) -> dict[str, Any]:
        """The MoE fields of the header: expert counts and widths; a layer without a router
        tensor (`ffn_gate_inp`) is dense."""
        a = self.arch
        experts = int(self.field(f"{a}.expert_count", 0) or 0)
        if not experts:
            return {}
        dense = tuple(i for i in range(blocks)
                      if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors)
        sparse = [i for i in range(blocks) if i not in dense]
        shexp = self.tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight") if sparse else None
        width = self.field(f"{a}.expert_feed_forward_length", None)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(self.field(f"{a}.expert_used_count")),
            "moe_intermediate_size": int(width if width is not None
                                         else self.field(f"{a}.feed_forward_length")),
            "norm_topk_prob": bool(self.field(f"{a}.expert_weights_norm", _NORM_TOPK[a])),
            "shared_expert_intermediate_size": 0 if shexp is None else int(shexp.shape[-1]),
            "dense_layers": dense,
        }

    def has(self, name: str) -> bool:
        if self.hybrid:
            return gguf_tensor_name(name, self.arch) in self.tensors
        try:
            return gguf_name(name) in self.tensors
        except KeyError:  # a name with no GGUF form (another layout's)
            return False

    def _read(self, canonical: str, shape: tuple[int, ...]) -> np.ndarray:
        if self.hybrid:
            src = tensor_source(canonical, shape, self.config, self.arch)
            if src is None:
                raise CheckpointError(f"{self.path}: {canonical!r} has no GGUF form for "
                                      f"{self.arch}")
            w = self._read_raw(src.name, canonical, src.shape)
            w = np.ascontiguousarray(src.convert(w), dtype=np.float32)
            assert w.shape == shape, (canonical, w.shape, shape)  # the name table's, not input
            return w
        w = self._read_raw(gguf_name(canonical), canonical, shape)
        if self.arch == "llama" and canonical.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, self.config.num_heads)
        elif self.arch == "llama" and canonical.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, self.config.num_kv_heads)
        return w

    def _read_raw(self, gname: str, canonical: str, shape: tuple[int, ...]) -> np.ndarray:
        """GGUF tensor `gname` dequantized to float32, checked to be of `shape`."""
        t, qtype = self._stored(gname, canonical, shape)
        try:
            w = _dequantize(self.header.raw(t), qtype)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {gname!r}: {e}") from e
        return np.asarray(w, dtype=np.float32).reshape(shape)

    def _stored(self, gname: str, canonical: str, shape: tuple[int, ...]) -> tuple[Any, Q]:
        """GGUF tensor `gname`'s table entry and type, checked: there, of a supported type and
        of `shape`."""
        t = self.tensors.get(gname)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {gname!r} is missing (for {canonical!r})")
        try:
            qtype = Q(t.type)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TYPES:
            qname = qtype.name if qtype is not None else f"#{t.type}"
            raise CheckpointError(
                f"{self.path}: tensor {gname!r} has quantization type {qname}, which is not "
                f"supported (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        got = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if got != shape:
            raise CheckpointError(
                f"{self.path}: tensor {gname!r} has shape {got}, expected {shape} from the header"
            )
        return t, qtype

    def _read_on(self, canonical: str, shape: tuple[int, ...], device: torch.device | str,
                 dtype: torch.dtype) -> torch.Tensor | None:
        """A dense model's tensor of a kept block type (`quant_blocks.KEPT_TYPES`) dequantized
        in float32 by torch where it is going (`device`), in chunks of rows
        (`DEQUANT_CHUNK_VALUES` values: a large embedding needs its `dtype` tensor and a
        chunk's float32 work, not several float32 copies of itself), and rounded to `dtype`:
        the stored bytes travel, not four bytes a weight, and a GPU does the arithmetic
        (`dequantize_rows`: gguf's float32 operations in gguf's order, one kernel each, so the
        values are `_read`'s bit for bit); llama's q/k rows un-permuted there too. None for the
        other tensors (`_read` reads them)."""
        if self.hybrid:
            return None
        t = self.tensors.get(gguf_name(canonical))
        try:
            if t is None or Q(t.type).name not in KEPT_TYPES:
                return None
        except ValueError:
            return None  # (an unknown type: `_read` names it)
        import torch
        from layersplit.shards.quant_blocks import dequantize_rows

        t, qtype = self._stored(t.name, canonical, shape)
        raw = self.header.raw(t)
        raw = raw.reshape(-1, raw.shape[-1])
        cols = raw.shape[-1] // KEPT_TYPES[qtype.name].size * KEPT_TYPES[qtype.name].block
        w = torch.empty(raw.shape[0], cols, dtype=dtype, device=device)
        step = max(1, DEQUANT_CHUNK_VALUES // max(cols, 1))
        for a in range(0, raw.shape[0], step):  # (in row chunks: the float32 work of a chunk
            # at a time on the device, not of the whole tensor; each value rounds alone)
            part = torch.tensor(raw[a:a + step], device=device)  # (a copy out of the map)
            w[a:a + step] = dequantize_rows(part, qtype.name).to(dtype)
        w = w.reshape(shape)
        if self.arch == "llama" and canonical.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, self.config.num_heads)
        elif self.arch == "llama" and canonical.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, self.config.num_kv_heads)
        return w

    def kept_type(self, canonical: str) -> str | None:
        """The block type (`quant_blocks.KEPT_TYPES`) of the stored tensor of `canonical`, a
        linear layer's weight; None where it is stored as floats (F32/F16/BF16). A quantized
        type that is not kept, or a hybrid architecture's file, is refused by name."""
        if self.hybrid:
            raise CheckpointError(
                f"{self.path}: keeping weights quantized is not implemented for the {self.arch} "
                "architecture; use weight_format = \"dequantize\"")
        t = self.tensors.get(gguf_name(canonical))
        if t is None:
            return None  # (missing: `load` names it)
        try:
            qtype = Q(t.type)
        except ValueError:
            return None  # (unknown: `load` names it)
        if qtype in (Q.F32, Q.F16, Q.BF16):
            return None
        if qtype.name not in KEPT_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} has type {qtype.name}, which is not kept "
                f"quantized (kept: {', '.join(KEPT_TYPES)}); use weight_format = \"dequantize\"")
        return qtype.name

    def load_blocks(self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The stored blocks of quantized tensors as uint8 rows (rows, row_bytes), copied out
        of the file (3-D experts' rows stacked by expert; llama's q/k rows un-permuted, whole
        rows at a time)."""
        import torch
        out: dict[str, torch.Tensor] = {}
        cache: dict[str, torch.Tensor] = {}
        for name, src in sources.items():
            if src not in cache:
                gname = gguf_name(src)
                t = self.tensors[gname]
                qtype = Q(t.type).name
                shape = shapes[name]  # (rows, k), or (experts, rows, k)
                got = tuple(int(x) for x in reversed(t.shape))
                if got != shape:
                    raise CheckpointError(f"{self.path}: tensor {gname!r} has shape {got}, "
                                          f"expected {shape} from the header")
                rows, k = int(np.prod(shape[:-1])), shape[-1]
                b = self.header.raw(t).reshape(rows, KEPT_TYPES[qtype].row_bytes(k))
                if self.arch == "llama" and src.endswith("self_attn.q_proj.weight"):
                    b = unpermute_rows(b, self.config.num_heads)
                elif self.arch == "llama" and src.endswith("self_attn.k_proj.weight"):
                    b = unpermute_rows(b, self.config.num_kv_heads)
                cache[src] = torch.tensor(np.ascontiguousarray(b), device=device)
            out[name] = cache[src]
        return out

    def load(
        self, shapes: dict[str, tuple[int, ...]], sources: dict[str, str], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        import torch
        out: dict[str, torch.Tensor] = {}
        cache: dict[str, torch.Tensor] = {}
        for name, src in sources.items():
            if src not in cache:
                w = self._read_on(src, shapes[name], device, dtype)
                cache[src] = (w if w is not None else  # (copy out of the map:)
                              torch.tensor(self._read(src, shapes[name]), dtype=dtype,
                                           device=device))
            out[name] = cache[src]
        return out
