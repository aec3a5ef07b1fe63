"""The single-process reference engine: the oracle the split runtime is tested against.

Whole model in this process, static KV cache, chunked prefill, one decode step per token, and the
same generation loop (`runtime.generate`) the split runtime uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from layersplit.runtime.generate import (
    Delta,
    GenerationResult,
    Progress,
    StepOutput,
    collect,
    stream_generation,
    token_stream,
)
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.accept import accept_draft
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.dtypes import torch_dtype
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.sampling import sample_rows
from layersplit.shards.sampling_params import SamplingParams, new_seed


class ReferenceEngine:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_context: int = 4096,
        prefill_chunk: int = 256,
        device: str = "cpu",
    ) -> None:
        ckpt = open_checkpoint(model_path)
        self.config = ckpt.config
        self.tokenizer = TextTokenizer.from_path(model_path)
        model = load_layer_range(ckpt, 0, ckpt.config.num_layers, torch_dtype(dtype), device)
        self.executor = RangeExecutor(model, max_context, device=device)
        self.chunk = prefill_chunk
        self.eos_ids = tuple(self.tokenizer.eos_ids) or tuple(self.config.eos_token_ids)

    # -- Engine protocol --------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], pos: int, sample: SamplingParams | None, seed: int,
                want_logits: bool = False, draft: Sequence[int] | None = None,
                tree: Sequence[int] | None = None,
                kept: Sequence[int] | None = None) -> StepOutput:
        x = torch.tensor(list(tokens), dtype=torch.long)
        self.executor.before_step(0, pos, kept)
        if draft is not None:  # a verify step, exactly as the last shard runs it
            rows = self.executor.run(x, pos, all_logits=True, verify=True, tree=tree)
            w = sample.wire()
            path, token = accept_draft(rows, list(draft), w["temperature"], w["top_k"],
                                       w["top_p"], seed, pos, tree)
            last = rows[path[-1] if path else 0]
            src = [0, *path[:-1]]  # the rows the kept draft tokens were drawn from
            return StepOutput(token, last.cpu().numpy() if want_logits else None, len(path),
                              list(path) if tree is not None else None,
                              kept_logits=rows[src].cpu().numpy() if want_logits and path
                              else None)
        logits = self.executor.run(x, pos)[-1]
        token = None
        if sample is not None:
            token = self.executor.sample(logits[None], {**sample.wire(), "seed": seed},
                                         pos + len(tokens))
        return StepOutput(token, logits.cpu().numpy() if want_logits else None)

    def sample_logits(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int) -> int:
        w = sample.wire()
        return sample_rows(torch.from_numpy(logits)[None], w["temperature"], w["top_k"],
                           w["top_p"], seed, [position])[0]

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits of every row of a fresh sequence, computed in prefill chunks."""
        from layersplit.shards.chunking import prefill_chunks

        rows = []
        for a, b in prefill_chunks(tokens, 0, len(tokens), self.chunk, self.eos_ids):
            x = torch.tensor(list(tokens[a:b]), dtype=torch.long)
            rows.append(self.executor.run(x, a, all_logits=True))
        return torch.cat(rows)

    # -- generation ---------------------------------------------------------------------------
    def stream(self, prompt: Sequence[int], params: SamplingParams,
               progress: Progress) -> Iterator[Delta]:
        seed = params.seed if params.seed is not None else new_seed()
        toks = token_stream(self, prompt, params, seed, chunk=self.chunk,
                            turn_end_ids=self.eos_ids, context=self.executor.max_len,
                            on_logits=None if progress.logits is None else progress.logits.append)
        return stream_generation(toks, self.tokenizer, params, self.eos_ids, progress)

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> GenerationResult:
        progress = Progress()
        return collect(self.stream(prompt, params, progress), progress, len(prompt))
