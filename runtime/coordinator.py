"""The coordinator: starts the shard chain, drives generation, notices failures.

Data plane: coordinator -> shard 0 -> shard 1 -> ... -> last shard -> coordinator. The coordinator
sends token ids to shard 0 and receives sampled tokens (and logits when asked) from the last
shard; it never relays activations. It knows of tensors only what the shards report.

`Coordinator` is built from parts of one job each, one module apiece:

- `runtime.shard_group.ShardGroup`: start-up, liveness, failure and shutdown of the processes;
- `runtime.draft_link.DraftLink`: the draft process (placement, start, requests, loss);
- `runtime.replies.Replies`: messages to the processes and the one wait for their replies;
- `runtime.step_driver.StepDriver`: steps through the chain and their results (`StepChain`);
- `runtime.request_flow.RequestFlow`: a request from its prompt to its tokens.

Their state is set here, in `Coordinator.__init__`. The batch, the prefix cache and the drafters
reach the coordinator only through the narrow interfaces they declare
(`runtime.batching.StepChain`, `runtime.cache_ops.CacheHost`, `runtime.speculative.DraftHost`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from layersplit.ipc.sockets import context
from layersplit.ipc.step_trace import step_trace
from layersplit.ipc.transport import RingInbox, Sender, host_id
from layersplit.runtime.batching import Batcher, Request
from layersplit.runtime.cache_ops import CacheManager
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.draft_link import DraftLink
from layersplit.runtime.errors import ShardFailure  # noqa: F401 - importable from here
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.model_store import resolve_draft, resolve_model
from layersplit.runtime.placement import (
    Placement,
    check_local_devices,
    describe_split,
    normalize_device,
    plan,
)
from layersplit.runtime.replies import Replies
from layersplit.runtime.request_flow import RequestFlow
from layersplit.runtime.shard_group import ShardGroup, _Shard
from layersplit.runtime.step_deadlines import StepDeadlines
from layersplit.runtime.step_driver import StepDriver
from layersplit.runtime.supervisor import LocalProcess, Prestarted
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.checkpoint import open_checkpoint
from layersplit.shards.dtypes import run_dtype
from layersplit.shards.model_config import context_limit_error
from layersplit.shards.quant_plan import kept_bytes, resolve_weight_format
from layersplit.shards.weights import layer_bytes

if TYPE_CHECKING:
    from layersplit.runtime.ray_launcher import RayLauncher, RayShard
    from layersplit.runtime.spec_policy import SpecPolicy

log = logging.getLogger(__name__)


class Coordinator(RequestFlow, StepDriver, Replies, DraftLink, ShardGroup):
    """Owns the shard processes of one model and drives generation: every request is a sequence
    of the batch (`runtime.batching`); `generate` / `stream` serve one, `submit` + `batcher`
    serve many (the HTTP server)."""

    def __init__(self, config: RuntimeConfig, prestarted: list[Prestarted] | None = None
                 ) -> None:
        """`prestarted`: shard and draft processes started ahead (`runtime.supervisor.
        prestart_shards`, `prestart_draft`), which `start` hands its local shards and its draft
        to; those it does not take are stopped there."""
        self.config = config
        self.prestarted = prestarted if prestarted is not None else []
        self.model_path = resolve_model(config.model)
        ckpt = open_checkpoint(self.model_path, config.random_seed)
        self.model_config = ckpt.config
        if (why := context_limit_error(ckpt.config, config.max_context)) is not None:
            raise ConfigError(f"{self.model_path}: {why}")
        self.dtype, why = run_dtype(config.dtype, ckpt.config.model_type, self.model_path,
                                    list(config.devices))
        log.info("dtype %s (%s)", self.dtype, why)
        self.weight_format, why = resolve_weight_format(config.weight_format, ckpt,
                                                        list(config.devices))
        log.info("weights %s (%s)", self.weight_format, why)
        itemsize = 4 if self.dtype == "float32" else 2
        size = None
        if self.weight_format == "quantized":
            def size(shapes):
                return kept_bytes(ckpt, ckpt.config, shapes, itemsize)
        sizes = layer_bytes(ckpt.config, itemsize, size) if config.split == "auto" else None
        self.placement: Placement = plan(config, ckpt.config.num_layers, sizes)
        if sizes is not None:
            log.info("split auto (by weight bytes): %s", describe_split(self.placement, sizes))
        if config.launcher == "local":  # (Ray finds GPUs on its nodes)
            check_local_devices(self.placement)
        self.ray: RayLauncher | None = None  # launcher = "ray": the chain's actors
        self.host = host_id()  # this coordinator's host, as the shards name theirs
        self.tokenizer = TextTokenizer.for_model(self.model_path)
        if config.chat_template and self.tokenizer is not None:
            try:
                self.tokenizer.chat_template = Path(config.chat_template).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"chat_template: cannot read {config.chat_template} ({e})"
                                 ) from None
        tok_eos = tuple(self.tokenizer.eos_ids) if self.tokenizer else ()
        self.eos_ids = tok_eos or tuple(self.model_config.eos_token_ids)
        self.chunk = config.prefill_chunk
        self.shards: list[_Shard] = []
        self.procs: list[LocalProcess] = []
        self.failed: str | None = None
        self._sid = 0
        self._run_dir: Path | None = None
        self._ctx = context()
        self.session = os.urandom(16)
        self._poller = zmq.Poller()
        self.step_observer = None  # (kind, seconds) -> None, e.g. a metrics histogram
        self.trace = step_trace("coordinator")  # (LAYERSPLIT_STEP_TRACE)
        self.cache: CacheManager | None = None
        self._steps: Sender | None = None  # steps to shard 0
        self._results: RingInbox | None = None  # results from the last shard, when local
        # the first shard's device: its GPU idles while the later shards finish the verify step,
        # and a draft sharing the last shard's GPU was 10-15 % slower (2 H200s, 2026-11-22)
        self.draft_device = normalize_device(config.draft_device or
                                             self.placement.shards[0].device)
        self.draft_path = resolve_draft(config.draft, self.model_path, self.draft_device)
        self._check_draft_placement()
        self.draft: _Shard | None = None  # the draft process, while it serves
        self.draft_info: dict[str, Any] = {}
        # what each shard captured at start ({graphs, seconds}, `capture_at_start`), in order
        self.warmed: list[dict[str, Any]] = []
        self.push_drafts = False  # the draft hands proposals to the first shard (`shards.asked`)
        self.spec_policy: SpecPolicy | None = None  # which steps speculate (`spec_policy`)
        self.board = False  # the first shard mapped the last one's token board (lookahead, split)
        self.draft_down: str | None = None  # why speculation stopped, if it did
        self._draft_proc: LocalProcess | RayShard | None = None
        self._draft_stopped_since: float | None = None  # when the draft was first seen stopped
        self._draft_stop_check = 0.0  # when to look again whether it is (`_check_alive`)
        self._alive_check = 0.0  # when `_wait` next looks whether the processes live
        self._feat_sids: dict[int, int] = {}  # draft context -> the last step whose tapped
        # rows went to it
        self._parked: dict[int, int] = {}  # draft context -> its last parked step, while its
        # rows may be parked on the shards
        self._unparking: set[int] = set()  # steps in flight, not parked, sent while some were
        # the draft's contexts (spec_max_seqs of them) not held by a sequence that feeds it
        self._free_contexts = list(range(config.spec_max_seqs))
        self._kept: list[tuple[list[int], Request]] = []  # turns being kept (`keep_turn`)
        self._in_flight: dict[int, tuple[float, float, str, int, int]] = {}  # step sid ->
        # deadline, start, kind, segments, rows
        self.deadlines = StepDeadlines(config.step_deadline_min, config.step_timeout)
        self._done: dict[int, Any] = {}  # step sid -> (result, logits, segments) or its failure
        self._back: collections.deque[int] = collections.deque(maxlen=256)  # sids of steps
        # back lately (a duplicate error about one is not about anything in flight)
        self.batcher: Batcher | None = None
        self.host_pool: HostPool | None = None  # the shards' host memory (`runtime.host_pool`)
        if config.spin_ms is not None:
            self.spin_ms = config.spin_ms
        else:  # spin on GPU hosts (decode latency); never on CPU-only runs (cores compute)
            self.spin_ms = 0.0 if all(s.device == "cpu" for s in self.placement.shards) else 20.0

    def fit_context(self, prompt_tokens: int, max_tokens: int) -> None:
        """Before `start`: size the run to one request (`layersplit generate`): `max_context`
        becomes its prompt and output (at least one token) rounded up to the graph bucket, never
        more than it was, so the KV pool and the graphs captured at start are those the request
        can reach, not a server's. A request that does not fit leaves it as it was (and is
        refused or stopped by it, as before)."""
        if self.shards:
            raise RuntimeError("fit_context: the runtime has started")
        bucket = max(1, self.config.graph_bucket)
        need = prompt_tokens + max(1, max_tokens)
        n = min(self.config.max_context, max(2, -(-need // bucket) * bucket))
        if n < need:
            return
        self.config = dataclasses.replace(self.config, max_context=n)

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
