"""Config.json fields every model family shares (`shards.model_config`, and the hybrid
families' own reader, `shards.hybrid_config`)."""

from __future__ import annotations

from typing import Any

from layersplit.shards.errors import CheckpointError

# config.json fields that never change a model's outputs at inference.
METADATA_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "name_or_path", "initializer_range", "use_cache", "pad_token_id",
    "bos_token_id", "eos_token_id", "sep_token_id", "attention_dropout", "hidden_dropout",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "auto_map", "is_decoder", "is_encoder_decoder", "task_specific_params",
    "problem_type", "finetuning_task", "chunk_size_feed_forward", "pruned_heads", "torchscript",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "prefix",
    "decoder_start_token_id", "max_length", "min_length", "do_sample", "num_beams",
    "temperature", "top_k", "top_p", "repetition_penalty", "use_bfloat16", "model_name",
    # seen in published Llama-family configs (SmolLM2's, older conversions): inert
    "is_llama_config", "max_sequence_length", "transformers.js_config",
})


# layer kinds of the families that alternate windowed and full attention (Gemma 3, gpt-oss)
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(source: str, types: Any, window: Any) -> bool:
    """Refuse a `layer_types` list with a kind we do not run, or a `sliding_window` that is not
    a positive integer where some layer is windowed; whether some layer is."""
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"{source}: layer_types={types!r}: entries must be one of "
                              f"{', '.join(LAYER_TYPES)}")
    sliding = "sliding_attention" in types
    if sliding and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise CheckpointError(f"{source}: sliding_window={window!r} must be a positive integer")
    return sliding
