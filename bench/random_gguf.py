"""A GGUF file of a Llama-family shape with seeded random weights, for the peer that reads only
GGUF (llama.cpp): decode speed does not depend on the weights' values, and the device machines
cannot carry an 8B file. The vocabulary is a real one (llama.cpp refuses a model without one),
exported once from a real GGUF into a small file:

    python bench/random_gguf.py --export-vocab SmolLM2-135M-Instruct.Q4_1.gguf vocab.json.gz
    python bench/random_gguf.py --shape configs/models/llama-8b-shape --vocab vocab.json.gz \
        --type f16 /tmp/llama8b-f16.gguf
    python bench/random_gguf.py --shape configs/models/smollm2-135m-shape --vocab vocab.json.gz \
        --type q4_1 /tmp/smol-q4_1.gguf      # the default model's file types: Q4_1, Q8_0 embedding
    python bench/random_gguf.py --shape configs/models/llama-8b-shape --vocab vocab.json.gz \
        --type q4_k_m /tmp/llama8b-q4km.gguf  # llama.cpp's Q4_K_M mix (widths of 256s only)

Q4_K_M follows llama.cpp's choice of types: Q4_K everywhere but attn_v and ffn_down of the
first and last eighth of the layers and every third layer between (Q6_K), and the output
(Q6_K). gguf-py cannot quantize to the K types: their blocks are random values with their
scales set (`shards.quant_blocks.random_blocks`).

The shape's config.json must have the vocabulary's size.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("bench.random_gguf")

VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.chat_template")


def export_vocab(src: Path, dst: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    out = {k: reader.fields[k].contents() for k in VOCAB_KEYS if k in reader.fields}
    with gzip.open(dst, "wt") as f:
        json.dump(out, f)
    log.info("%s: %d tokens, %d merges", dst, len(out["tokenizer.ggml.tokens"]),
             len(out.get("tokenizer.ggml.merges", [])))


def add_vocab(w, vocab: dict) -> None:
    w.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in vocab:
        w.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    w.add_token_list(vocab["tokenizer.ggml.tokens"])
    w.add_token_types(vocab["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in vocab:
        w.add_token_merges(vocab["tokenizer.ggml.merges"])
    if "tokenizer.chat_template" in vocab:
        w.add_chat_template(vocab["tokenizer.chat_template"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("padding", w.add_pad_token_id), ("unknown", w.add_unk_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in vocab:
            add(vocab[f"tokenizer.ggml.{key}_token_id"])


def write_random(shape_dir: Path, vocab_file: Path, ftype: str, dst: Path, seed: int = 0) -> None:
    import gguf
    from layersplit.shards.quant_blocks import random_blocks

    cfg = json.loads((shape_dir / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise SystemExit(f"{shape_dir}: model_type {cfg.get('model_type')!r}: this writes "
                         "llama-architecture files only")
    with gzip.open(vocab_file, "rt") as f:
        vocab = json.load(f)
    if len(vocab["tokenizer.ggml.tokens"]) != cfg["vocab_size"]:
        raise SystemExit(f"{vocab_file} has {len(vocab['tokenizer.ggml.tokens'])} tokens, the "
                         f"shape {cfg['vocab_size']}")
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // heads
    types = gguf.GGMLQuantizationType
    matrix_type = {"f16": types.F16, "q4_1": types.Q4_1, "q8_0": types.Q8_0,
                   "q4_k_m": types.Q4_K}[ftype]
    embed_type = types.Q8_0 if ftype == "q4_1" else matrix_type
    out_type = types.Q6_K if ftype == "q4_k_m" else embed_type
    layers = cfg["num_hidden_layers"]

    def more_bits(i: int) -> bool:  # llama.cpp's `use_more_bits` (Q4_K_M's attn_v, ffn_down)
        return ftype == "q4_k_m" and (i < layers // 8 or i >= 7 * layers // 8 or
                                      (i - layers // 8) % 3 == 2)
    w = gguf.GGUFWriter(dst, "llama")
    w.add_name(f"random {shape_dir.name}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 8192))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w, vocab)
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(1 << 22) * 0.02).astype(np.float32)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        data = np.resize(block, (rows, cols))  # tiles the random block: values do not matter
        if qtype == types.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif qtype in (types.Q4_K, types.Q5_K, types.Q6_K):
            b = random_blocks(rows, cols, qtype.name, rng)
            w.add_tensor(name, b, raw_shape=b.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))

    t0 = time.perf_counter()
    matrix("token_embd.weight", cfg["vocab_size"], hidden, embed_type)
    for i in range(cfg["num_hidden_layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", heads * hd, hidden, matrix_type)
        matrix(f"blk.{i}.attn_k.weight", kv * hd, hidden, matrix_type)
        matrix(f"blk.{i}.attn_v.weight", kv * hd, hidden,
               types.Q6_K if more_bits(i) else matrix_type)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * hd, matrix_type)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", cfg["intermediate_size"], hidden, matrix_type)
        matrix(f"blk.{i}.ffn_up.weight", cfg["intermediate_size"], hidden, matrix_type)
        matrix(f"blk.{i}.ffn_down.weight", hidden, cfg["intermediate_size"],
               types.Q6_K if more_bits(i) else matrix_type)
        log.info("layer %d/%d built (%.1f s)", i + 1, cfg["num_hidden_layers"],
                 time.perf_counter() - t0)
    norm("output_norm.weight")
    if not cfg.get("tie_word_embeddings", False):
        matrix("output.weight", cfg["vocab_size"], hidden, out_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    log.info("%s: %.2f GB in %.1f s", dst, dst.stat().st_size / 1e9, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-vocab", nargs=2, metavar=("GGUF", "OUT"), default=None)
    ap.add_argument("--shape", type=Path, help="a folder with the shape's config.json")
    ap.add_argument("--vocab", type=Path, help="a file from --export-vocab")
    ap.add_argument("--type", default="f16", choices=["f16", "q4_1", "q8_0", "q4_k_m"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", nargs="?", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.export_vocab:
        export_vocab(Path(args.export_vocab[0]), Path(args.export_vocab[1]))
        return
    if not (args.shape and args.vocab and args.out):
        ap.error("--shape, --vocab and OUT are needed (or --export-vocab)")
    write_random(args.shape, args.vocab, args.type, args.out, args.seed)


if __name__ == "__main__":
    main()
