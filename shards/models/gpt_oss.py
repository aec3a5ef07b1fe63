"""gpt-oss (`gpt_oss`, `shards.gpt_oss_config`): Llama-like attention with q/k/v and o_proj
biases and a learnt sink logit per head (`Attention.sinks`: the fused attention kernels take
none, so its layers attend through `attend_sinks` in prefill and the grouped matmuls in decode
and verify steps), sliding and full layers alternating, YaRN rope, RMSNorms that multiply in
float32, and in every layer `OssMoE` (biased router, softmax over the top k, clamped SwiGLU
experts with biases). Runs unfused on GPUs (`shards.fused`'s decode step is the Llama
layout's), but its captured steps attend through the Triton decode-attention kernel, which takes
the sinks (`Attention.graph_attention`), and its weights take their GPU layout there
(`fuse_weights`)."""

from __future__ import annotations

import torch
from layersplit.shards.layers.norm import FloatProductRMSNorm
from layersplit.shards.layers.oss_moe import OssMoE
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import llama
from torch import nn

FinalNorm = FloatProductRMSNorm  # the last range's norm (`LayerRange`)
# the norms' weights stay float32 in any run dtype, as in transformers (`_keep_in_fp32_modules`)
FLOAT32_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                   "model.norm.weight")


class DecoderLayer(llama.DecoderLayer):
    UNFUSED_WHY = ("attention sinks, which the flash / cuDNN prefill kernels do not take: "
                   "prefill attends with matmuls and the sinks in the softmax; the captured "
                   "steps attend through the Triton decode-attention kernel, which takes them")

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = FloatProductRMSNorm(h, eps)
        self.post_attention_layernorm = FloatProductRMSNorm(h, eps)
        a = self.self_attn
        a.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.attention_bias)
        a.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        self.mlp = OssMoE(cfg)

    def fuse_weights(self) -> None:
        """The GPU layout of the weights (one q/k/v matrix, the experts' for the grouped GEMM)
        for a layer that runs without `shards.fused`'s decode step."""
        self.self_attn.fuse()
        self.mlp.fuse()
