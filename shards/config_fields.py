"""Config.json fields every model family shares (`shards.model_config`, and the hybrid
families' own reader, `shards.hybrid_config`)."""

from __future__ import annotations

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
