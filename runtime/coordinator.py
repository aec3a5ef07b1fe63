"""The coordinator: starts the shard chain, drives generation, notices failures.

Data plane: coordinator -> shard 0 -> shard 1 -> ... -> last shard -> coordinator. The coordinator
sends token ids to shard 0 and receives sampled tokens (and logits when asked) from the last
shard; it never relays activations. It knows of tensors only what the shards report.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq
from layersplit.ipc import auth
from layersplit.ipc.curve import needs_curve
from layersplit.ipc.messages import ProtocolError, message, segment
from layersplit.ipc.shm import HEADER_CAP, SLEEP_POLL_MS
from layersplit.ipc.sockets import (
    connect_dealer,
    context,
    free_tcp_port,
    recv,
    ring_doorbell,
    run_dir,
    send,
)
from layersplit.ipc.step_trace import step_trace
from layersplit.ipc.transport import (
    RingInbox,
    Sender,
    ZmqSender,
    accept,
    host_id,
    offer,
    zmq_tensor,
)
from layersplit.runtime.batching import MAX_IN_FLIGHT, Batcher, Request
from layersplit.runtime.cache_ops import CacheManager, Restored
from layersplit.runtime.chunking import cut_points
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.decoding import LATE_MASK, Decoding, StepFields
from layersplit.runtime.errors import DraftError, DraftLost, ShardFailure
from layersplit.runtime.generate import (
    Delta,
    GenerationResult,
    OutputStream,
    Program,
    Progress,
    StepOutput,
    StepRequest,
    collect,
    sequence_program,
)
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.kv_pool import host_pool_plan, kv_pool_blocks
from layersplit.runtime.model_store import resolve_draft, resolve_model
from layersplit.runtime.placement import (
    Placement,
    PlacementError,
    ShardPlan,
    check_local_devices,
    describe_split,
    normalize_device,
    plan,
)
from layersplit.runtime.reference import new_seed
from layersplit.runtime.scheduler import SchedulerConfig
from layersplit.runtime.speculative import (
    DraftClient,
    SpecStats,
    draft_taps,
    spec_sampling_mode,
    tree_size,
    verify_shape,
)
from layersplit.runtime.step_deadlines import StepDeadlines
from layersplit.runtime.supervisor import (
    LocalProcess,
    Prestarted,
    draft_argv,
    drop_prestarted,
    spawn_draft,
    spawn_shard,
    stop_all,
)
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.checkpoint import open_checkpoint
from layersplit.shards.dtypes import run_dtype
from layersplit.shards.layers.rotary import context_limit_error
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.weights import layer_bytes
from zmq.utils.monitor import recv_monitor_message

if TYPE_CHECKING:
    from layersplit.runtime.ray_launcher import RayLauncher, RayShard

log = logging.getLogger(__name__)
POLL_MS = 50
CLOSE_DRAIN_S = 5.0  # at close, steps still in the chain get this long to come back

REMOTE_CONNECT_S = 30.0
DRAFT_TIMEOUT_S = 60.0  # a proposal (or the draft's part of a cache operation) never takes this


def _name(sh: _Shard) -> str:
    return "the draft process" if sh.index < 0 else f"shard {sh.index}"


DRAFT_STOPPED_S = 2.0  # a stopped draft process is dropped after this (speculation stops)

class _Shard:
    """A server process of the run: a shard (index 0..N-1) or the draft process (index -1)."""

    def __init__(self, index: int, address: str, sock: zmq.Socket, monitor: zmq.Socket,
                 proc: LocalProcess | None) -> None:
        self.index, self.address, self.sock, self.monitor, self.proc = (
            index, address, sock, monitor, proc)
        self.info: dict[str, Any] = {}
        self.local = False  # on this host: steps and results may travel through shared memory
        self.host = ""  # the host it names in its welcome (`ipc.hosts.host_id`)
        self.welcomed = False  # its handshake completed

    @property
    def streams_cache(self) -> bool:
        """A shard this coordinator did not start (`layersplit shard`, on another host or in a
        container of its own) may not see the cache directory: its prefix-cache tensors travel
        over its (encrypted) channel, and the coordinator reads and writes the file. So do the
        shards Ray placed on another node (`runtime.ray_launcher`)."""
        return self.proc is None or not self.local


class Coordinator:
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
        itemsize = 4 if self.dtype == "float32" else 2
        sizes = layer_bytes(ckpt.config, itemsize) if config.split == "auto" else None
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
        self.board = False  # the first shard mapped the last one's token board (lookahead, split)
        self.draft_down: str | None = None  # why speculation stopped, if it did
        self._draft_proc: LocalProcess | RayShard | None = None
        self._draft_stopped_since: float | None = None  # when the draft was first seen stopped
        self._feat_sids: dict[int, int] = {}  # draft context -> the last step whose tapped
        # rows went to it
        # the draft's contexts (spec_max_seqs of them) not held by a sequence that feeds it
        self._free_contexts = list(range(config.spec_max_seqs))
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

    def start(self) -> None:
        cfg, shards = self.config, self.placement.shards
        remote = any(s.address for s in shards)
        secret = auth.load_secret(cfg.secret_file) if remote else None
        if remote and secret is None:
            raise ShardFailure("remote shards need the shared secret: set --secret-file or "
                               f"${auth.SECRET_ENV} (the same one the shards were started with)")
        self.secret = secret or auth.new_secret()
        self._run_dir = run_dir()
        local_cpu = sum(1 for s in shards if s.address is None and s.device == "cpu")
        threads = cfg.threads or (max(1, (os.cpu_count() or 1) // max(local_cpu, 1))
                                  if local_cpu else None)
        t0 = time.perf_counter()
        itemsize = 4 if self.dtype == "float32" else 2
        try:
            # (under Ray every process gets `threads` or 1, as its bundle has CPUs)
            ray_shards = self._start_ray(t0, cfg.threads or 1) if cfg.launcher == "ray" else []
            addresses = [r.address for r in ray_shards]
            for s in shards[len(ray_shards):]:
                if s.address:
                    addresses.append(s.address)
                    continue
                if cfg.local_addresses == "tcp":
                    addr = f"tcp://127.0.0.1:{free_tcp_port()}"
                else:
                    addr = f"ipc://{self._run_dir}/shard{s.index}.sock"
                addresses.append(addr)
                proc = spawn_shard(s, addr, str(self.model_path), self.dtype,
                                   threads if s.device == "cpu" else None, self.secret,
                                   self._run_dir, cfg.random_seed, self.prestarted,
                                   cfg.fork_cpu_processes)
                self.procs.append(proc)
            if self.draft_path is not None:
                self._spawn_draft(threads)
            drop_prestarted(self.prestarted)  # (more than the run's local processes)
            for s, addr in zip(shards, addresses):
                # heartbeats for shards on other hosts (by hand, or placed by Ray): local
                # ones are watched as processes
                remote = bool(s.address) or cfg.launcher == "ray"
                sock = connect_dealer(self._ctx, addr, self.secret,
                                      identity=b"coord-" + self.session[:8],
                                      heartbeat_s=cfg.heartbeat_timeout if remote else None)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                proc = next((p for p in [*self.procs, *ray_shards] if p.plan.index == s.index),
                            None)
                self.shards.append(_Shard(s.index, addr, sock, monitor, proc))
                self._poller.register(sock, zmq.POLLIN)
                self._poller.register(monitor, zmq.POLLIN)
            for sh in self.shards:
                deadline = t0 + cfg.startup_timeout
                if sh.proc is None:  # a remote shard is already loaded: it answers at once
                    deadline = min(deadline, time.monotonic() + REMOTE_CONNECT_S)
                self._handshake(sh, deadline)
            try:
                taps = self._configure_draft(t0 + cfg.startup_timeout, max(cfg.prefill_chunk, 1))
            except (DraftLost, DraftError) as e:
                raise ShardFailure(f"the draft process ({self.draft_path}) could not start: "
                                   f"{e}") from None
            # a step carries one prefill chunk and every sequence's decode or verify rows (a
            # token tree's for those that speculate)
            info = self.draft_info if self.draft is not None else {}
            block = int(info.get("block_size", 1))
            extra = max(0, tree_size(info, cfg, max(cfg.prefill_chunk, 1)) + 1 - block)
            max_step = (max(cfg.prefill_chunk, 1) + cfg.max_seqs * block
                        + min(max(cfg.spec_max_seqs, 1), cfg.max_seqs) * extra)
            first, last = self.shards[0], self.shards[-1]
            self.kv_blocks = kv_pool_blocks(cfg, self.model_config, self.placement, itemsize)
            log.info("KV pool: %d blocks of %d tokens per shard (%d tokens in all sequences)",
                     self.kv_blocks, cfg.kv_block, self.kv_blocks * cfg.kv_block)
            # each shard's host memory, for swapped-out sequences and RAM-tier snapshots (a
            # hybrid model's recurrent state is not in blocks: its sequences are not swapped)
            host = host_pool_plan(cfg, self.model_config, self.placement, itemsize,
                                  self.kv_blocks)
            self.kv_host_blocks = host.blocks
            self.host_pool = HostPool(host.capacity, host.block_bytes)
            if self.kv_host_blocks:
                log.info("host KV pool: %d blocks per shard (swap preemption)",
                         self.kv_host_blocks)
            log.info("host memory per shard (swapped KV and RAM-tier snapshots): %s MB",
                     ", ".join(f"{c / 2**20:.0f}" for c in host.capacity))
            # decode lookahead (`shards.decode_ahead`): the first shard takes each lookahead
            # step's token where the last one sampled it (its own memory with one shard, else
            # a token board the two share on one host). Not for a hybrid model: its recurrent
            # state must never take a row twice, as a dropped lookahead row of a sequence that
            # goes on would be
            ahead = (cfg.decode_ahead and self.model_config.hybrid is None
                     and len(self.shards) > 1 and first.host == last.host)
            board: Any = None
            self.board = False
            for sh in reversed(self.shards):  # downstream first, so each link finds its peer
                nxt = None
                if sh.index + 1 < len(self.shards):
                    nxt = {"address": self.shards[sh.index + 1].address}
                transport = (self.placement.transports[sh.index]
                             if sh.index < len(self.placement.transports) else "auto")
                extra: dict[str, Any] = {}
                if sh is last and sh.local:  # results come back through a ring we own
                    # (a logits row for each sequence of a step at most)
                    self._results, desc = offer("shm", self.model_config.vocab_size * 4 *
                                                cfg.max_seqs, torch.device("cpu"))
                    extra["results"] = desc
                if sh is first and sh.local:
                    extra["inbox"] = True
                if ahead and sh is last:  # each slot's last sampled token, for the first shard
                    extra["board"] = True
                elif ahead and sh is first:
                    extra["board"] = board
                planned = self.placement.shards[sh.index]
                mine = [t for t in taps if planned.start <= t < planned.end]
                if mine and self.draft is not None:
                    feed = cfg.transport[0] if len(cfg.transport) == 1 else "auto"
                    extra.update(taps=mine, draft={"address": self.draft.address,
                                                   "transport": feed})
                reply = self._call(sh, message(
                    "configure", session=self.session, next=nxt, max_context=cfg.max_context,
                    max_step_tokens=max_step, slots=cfg.max_seqs, transport=transport,
                    kv_block=cfg.kv_block, kv_blocks=self.kv_blocks, index=sh.index,
                    kv_host_blocks=self.kv_host_blocks,
                    cuda_graphs=cfg.cuda_graphs, graph_bucket=cfg.graph_bucket,
                    torch_compile=cfg.torch_compile, deterministic=cfg.deterministic,
                    cache_dir=str(Path(cfg.kv_cache_dir).expanduser().resolve())
                    if cfg.kv_cache_dir else None,
                    spin_ms=self.spin_ms, **extra,
                ), t0 + cfg.startup_timeout)
                sh.info = reply["info"]
                if ahead and sh is last:
                    board = sh.info.pop("board", None)
                    if board is None:
                        raise ShardFailure(f"{_name(sh)} made no token board for decode "
                                           "lookahead: its layersplit is older; run the same "
                                           "version everywhere")
                if bool(sh.info.get("deterministic")) != cfg.deterministic:
                    raise ShardFailure(f"{_name(sh)} reports deterministic="
                                       f"{sh.info.get('deterministic')!r} where the run asked "
                                       f"for {cfg.deterministic}: its layersplit does not "
                                       "take the setting; run the same version everywhere")
                if sh is first:
                    self.board = bool(sh.info.pop("board", False))
                    inbox = sh.info.pop("inbox", None)
                    if inbox is not None:
                        self._steps = accept("shm", inbox,
                                             functools.partial(ring_doorbell, sh.sock))
                    else:
                        self._steps = ZmqSender(sh.sock)
                log.info(
                    "shard %d ready: layers %d:%d on %s, %.0f MB, KV %d tokens (%.0f MB), "
                    "out via %s", sh.index, *sh.info["layers"], sh.info["device"],
                    sh.info["memory_bytes"] / 2**20, sh.info["kv_capacity_tokens"],
                    sh.info["kv_bytes"] / 2**20, sh.info["transport_out"],
                )
            if cfg.capture_at_start and cfg.cuda_graphs:
                self._warm(t0 + cfg.startup_timeout)
            if cfg.prefix_cache:
                self.cache = CacheManager(self)
            groups = min(cfg.micro_batches or len(self.shards), cfg.max_seqs, MAX_IN_FLIGHT)
            self.batcher = Batcher(self, SchedulerConfig(
                slots=cfg.max_seqs, slot_tokens=cfg.max_context, block_tokens=cfg.kv_block,
                micro_batches=groups, step_tokens=max_step, num_blocks=self.kv_blocks),
                host_blocks=self.kv_host_blocks, host_pool=self.host_pool)
            # a hybrid model's sequence is also its recurrent state, which blocks do not hold
            self.batcher.share_prefixes = self.model_config.hybrid is None
            self.batcher.look_ahead = (cfg.decode_ahead and self.model_config.hybrid is None
                                       and (len(self.shards) == 1 or self.board))
            if cfg.decode_ahead and len(self.shards) > 1 and first.host != last.host:
                log.info("decode lookahead off: the first and last shard are on different "
                         "hosts (they share no token board)")
        except BaseException:
            self.close()
            raise
        log.info("%d shards ready in %.1f s", len(self.shards), time.perf_counter() - t0)

    def _warm(self, deadline: float) -> None:
        """Every shard captures, all at once, each step graph a request may replay (and
        compiles what it compiles on first use): decode steps, the draft's verify steps, batched
        steps up to max_seqs sequences, batched verify steps up to spec_max_seqs sequences, for
        every KV-length bucket (`StaticDecoder.warm`). A
        CPU shard answers at once."""
        cfg = self.config
        rows, verify_batch = [1], 0
        if self.draft is not None and not cfg.deterministic:  # (deterministic: one-row steps)
            block, tree = verify_shape(self.draft_info, cfg, self.chunk)
            rows += [block] + ([1 + tree] if tree else [])
            # the verify steps of the sequences that speculate at once, batched
            verify_batch = min(cfg.spec_max_seqs, cfg.max_seqs)
        t0 = time.perf_counter()
        replies = self.call_all(
            lambda sh: message("warm", rows=rows, batch=1 if cfg.deterministic else cfg.max_seqs,
                               verify_batch=verify_batch),
            deadline=deadline, what="the graph captures at start")
        self.warmed = [r["info"] for r in replies]  # each shard's {graphs, seconds}
        graphs = sum(int(i.get("graphs", 0)) for i in self.warmed)
        if graphs:
            log.info("%d step graphs captured in %.1f s (capture_at_start)", graphs,
                     time.perf_counter() - t0)

    def _start_ray(self, t0: float, threads: int | None) -> list[RayShard]:
        """launcher = "ray": place and start every shard on the Ray cluster, and the draft
        process on the first shard's node."""
        from layersplit.runtime.ray_launcher import DraftLaunch, RayLauncher

        self.ray = RayLauncher(self.config)
        draft = None
        if self.draft_path is not None:
            draft = DraftLaunch(tuple(self._draft_argv(threads)), self.draft_device)
        started = self.ray.start(self.placement.shards, self.config.model, self.dtype,
                                 self.config.random_seed, self.secret,
                                 time.monotonic() + self.config.startup_timeout - (
                                     time.perf_counter() - t0), draft)
        self.host = self.ray.host_id
        return started

    # ---- the draft process --------------------------------------------------------------------
    def _check_draft_placement(self) -> None:
        """The draft process runs on this host: its device must be here, and the shards that
        feed it their rows too (`auto` gives up speculation when some shard is remote)."""
        if self.draft_path is None:
            return
        if self.config.launcher == "ray":  # placed on the first shard's node (`_start_ray`)
            first = self.placement.shards[0].device
            if self.draft_device not in ("cpu", first):
                raise PlacementError(
                    f"draft_device = {self.draft_device!r}: with launcher = 'ray' the draft "
                    f"runs on the first shard's node, on its device ({first}) or on cpu")
            return
        remote = [s for s in self.placement.shards if s.address]
        if remote and self.config.draft == "auto":
            self.draft_path = None
            return
        taps = draft_taps(self.draft_path)
        far = [s.index for s in remote if any(s.start <= t < s.end for t in taps)]
        if far:
            raise PlacementError(f"shard {far[0]} is remote but owns a layer the DFlash draft "
                                 f"taps ({taps}); its rows cannot reach the draft process here. "
                                 "Use a classic draft or --draft none")
        check_local_devices(Placement((ShardPlan(-1, 0, 1, self.draft_device, None),), ()))

    def _draft_argv(self, threads: int | None) -> list[str]:
        cfg = self.config
        # under Ray the target is named as configured (resolved on the draft's node)
        target = cfg.model if cfg.launcher == "ray" else str(self.model_path)
        return draft_argv(str(self.draft_path), target, self.draft_device, self.dtype,
                          cfg.max_context, threads if self.draft_device == "cpu" else None,
                          cfg.random_seed, cfg.spec_block, cfg.cuda_graphs, cfg.draft_compile)

    def _spawn_draft(self, threads: int | None) -> None:
        """Start the draft process here (or take the one Ray started) and connect to it."""
        cfg = self.config
        if self.ray is not None:  # on the first shard's node: its channel gets heartbeats
            self._draft_proc = self.ray.draft
            addr, heartbeat = self.ray.draft.address, cfg.heartbeat_timeout
        else:
            addr = (f"tcp://127.0.0.1:{free_tcp_port()}" if cfg.local_addresses == "tcp"
                    else f"ipc://{self._run_dir}/draft.sock")
            self._draft_proc = spawn_draft(addr, self._draft_argv(threads), self.draft_device,
                                           self.secret, self._run_dir, self.prestarted,
                                           cfg.fork_cpu_processes)
            heartbeat = None
        sock = connect_dealer(self._ctx, addr, self.secret,
                              identity=b"coord-" + self.session[:8], heartbeat_s=heartbeat)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.draft = _Shard(-1, addr, sock, monitor, self._draft_proc)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _configure_draft(self, deadline: float, max_step: int) -> list[int]:
        """Authenticate and configure the draft process (before the shards that feed it);
        returns the target layers it taps. A draft that cannot start fails the start."""
        d = self.draft
        if d is None:
            if self.draft_path is not None:  # it died while the shards were loading
                raise DraftLost(self.draft_down or "it is gone")
            return []
        nonce = auth.new_nonce()
        reply = self._call(d, message("hello", nonce=nonce, role="coordinator"), deadline)
        if reply["type"] == "challenge":
            reply = self._call(d, message("auth", mac=auth.mac(self.secret, reply["nonce"], nonce,
                                                               "coordinator")), deadline)
        if reply["type"] != "welcome":
            raise ShardFailure(f"the draft process refused the handshake: {reply.get('message')}")
        d.welcomed = True
        d.local = reply["host"] == self.host  # else its cache tensors travel on its channel
        taps = draft_taps(self.draft_path)
        # each shard sends the rows of the tapped layers it owns
        feeders = [[t for t in taps if s.start <= t < s.end] for s in self.placement.shards]
        # the draft hands its prepared proposals to the first shard where that one feeds it
        # and the last one does too (the last shard sends the verdict on its feed)
        self.push_drafts = bool(self.config.spec_push and feeders and feeders[0]
                                and feeders[-1])
        reply = self._call(d, message(
            "draft_configure", session=self.session, max_context=self.config.max_context,
            max_rows=max_step, feeders=[f for f in feeders if f], spin_ms=self.spin_ms,
            push=self.push_drafts,
            slots=max(1, self.config.spec_max_seqs),
            cache_dir=str(Path(self.config.kv_cache_dir).expanduser().resolve())
            if self.config.kv_cache_dir else None), deadline)
        self.draft_info = reply["info"]
        log.info("draft ready: %s on %s, %d tokens per verify step%s, %.0f MB",
                 self.draft_info["kind"], self.draft_info["device"],
                 self.draft_info["block_size"],
                 f", taps layers {taps}" if taps else "",
                 self.draft_info["memory_bytes"] / 2**20)
        return taps

    def _lose_draft(self, why: str) -> None:
        """The draft failed: speculation stops for the rest of this run (logged); the shards
        stop sending it rows (steps say so), and it is killed if it still runs."""
        d = self.draft
        if d is None:
            return
        self.draft, self.draft_down = None, why
        log.warning("speculative decoding stops: %s", why)
        if self.push_drafts and self.shards and not self.shards[0].sock.closed:
            try:  # a step the first shard holds for a proposal runs without it
                send(self.shards[0].sock, message("draft_gone"))
            except zmq.ZMQError as e:
                log.warning("could not tell the first shard the draft is gone (%s): a step "
                            "it holds runs after its wait", e)
        if self.cache is not None:  # saves waiting for its feature rows go on without them
            self.cache.draft_lost()
        for sock in (d.sock, d.monitor):
            try:
                self._poller.unregister(sock)
            except KeyError:  # never registered: the draft failed while starting
                pass
        d.monitor.close(0)
        d.sock.disable_monitor()
        d.sock.close(0)
        if isinstance(self._draft_proc, LocalProcess):
            stop_all([self._draft_proc], grace_s=0.0, term_s=0.0)
        elif self._draft_proc is not None and self.ray is not None:
            self.ray.stop_draft()

    @property
    def feeding(self) -> bool:
        """Steps send tapped rows to the draft (a feature-conditioned draft serves)."""
        return self.draft is not None and bool(self.draft_info.get("taps"))

    def spec_sampling_mode(self) -> str:
        """`spec_sampling` as it applies to this runtime's sampled requests
        (`runtime.speculative.spec_sampling_mode`: `auto` resolved by the devices and the
        draft's kind)."""
        devices = [s.device for s in self.placement.shards] + [self.draft_device]
        return spec_sampling_mode(self.config.spec_sampling, devices,
                                  self.draft_info.get("kind"))

    def _give_back_context(self, context: int) -> None:
        """A draft context back among the free ones (the lowest is taken first)."""
        self._free_contexts = sorted([*self._free_contexts, context])

    def draft_request(self, msg: dict[str, Any], frames: Sequence[Any] = ()) -> dict[str, Any]:
        """One request to the draft process and its reply. Raises DraftLost if the draft is
        gone (speculation is then off), DraftError for an error reply."""
        d = self.draft
        if d is None:
            raise DraftLost(self.draft_down or "no draft process")
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        send(d.sock, {**msg, "sid": sid}, frames)
        timeout = min(self.config.step_timeout, DRAFT_TIMEOUT_S)  # the draft is warm by now
        if msg["type"] != "propose":  # no compute: a silent draft (no heartbeats on one host)
            timeout = min(timeout, self.config.step_deadline_min)  # loses speculation sooner
        reply, frames = self._wait(lambda s, m: s is d and m.get("sid") == sid,
                                   time.monotonic() + timeout, f"{msg['type']} to the draft",
                                   sid, on_draft=True)
        return reply if not frames else {**reply, "_frames": frames}

    def close(self) -> None:
        drop_prestarted(self.prestarted)  # (a start that failed before it took them)
        if self.trace is not None:
            self.trace.close()
        if self.failed is None and self.shards and self._in_flight:
            # steps still in the chain (of cancelled requests): let them out first, for a few
            # seconds at most (a close on Ctrl-C may come between a result read off the ring
            # and its bookkeeping: that step is never seen back, and its deadline can be
            # minutes away)
            give_up = time.monotonic() + CLOSE_DRAIN_S
            try:
                self._wait(lambda s, m: False, max(d for d, *_ in self._in_flight.values()),
                           "steps at shutdown",
                           until=lambda: not self._in_flight or time.monotonic() >= give_up)
            except ShardFailure:
                pass
        if self.cache is not None and self.failed is None and self.shards:
            self._finish_saves(timeout_s=120.0)
        if self.cache is not None:
            self.cache.abandon_saves()
        self.cache = None
        for ring in (self._steps, self._results):
            if ring is not None:
                ring.close()
        self._steps = self._results = None
        members = self.shards + ([self.draft] if self.draft is not None else [])
        # local shards exit, upstream first: a shard maps the ring its downstream neighbour owns
        # (and the draft those of its feeders) and lets go of it by exiting before the owner
        # does (a CUDA IPC owner that exits first warns of shared tensors not yet released);
        # remote shards keep serving and await the next coordinator
        grace = time.monotonic() + 5.0
        for sh in members:
            try:
                if self.failed is None and sh.proc is not None and not sh.sock.closed:
                    send(sh.sock, message("shutdown"))
                    sh.proc.proc.wait(max(0.0, grace - time.monotonic()))
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
        procs = self.procs + ([self._draft_proc] if isinstance(self._draft_proc, LocalProcess)
                              else [])
        if self.failed is None:
            stop_all(procs)
        else:  # a failed group is torn down at once: a hung shard will not answer SIGTERM,
            stop_all(procs, grace_s=0.0, term_s=0.0)  # and its KV is lost anyway
        if self.ray is not None:  # its actors, their shard processes and its placement group
            self.ray.stop(grace_s=5.0 if self.failed is None else 0.0)
            self.ray = None
        self._poller = zmq.Poller()
        for sh in members:
            sh.monitor.close(0)
            sh.sock.disable_monitor()
            sh.sock.close(0)
        self.shards, self.procs, self.draft, self._draft_proc = [], [], None, None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def _finish_saves(self, timeout_s: float) -> None:
        """Let pending cache writes complete (graceful shutdown)."""
        deadline = time.monotonic() + timeout_s
        cache = self.cache
        try:
            while cache.pending() and time.monotonic() < deadline:
                self._drain(wait_ms=20)
                cache.poll_done()
            cache.poll_done()
        except ShardFailure:
            pass
        if cache.pending():
            log.warning("prefix cache: %d saves still pending at shutdown; abandoned",
                        cache.pending())

    def call_all(self, make, draft: Any = None, deadline: float | None = None,
                 what: str = "a prefix-cache operation") -> list[dict[str, Any]]:
        """Send `make(shard)` (a message, or a message and its payload frames) to every shard,
        and `draft` (the same) to the draft process when given and it serves; return the `ok`
        replies, shards in order, then the draft's, by `deadline` (default: step_timeout from
        now). A draft lost meanwhile just does not reply (speculation is off from then on)."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        for sh in self.shards:
            made = make(sh)  # a message, or (message, payload frames)
            msg, frames = made if isinstance(made, tuple) else (made, ())
            send(sh.sock, {**msg, "sid": sid}, frames)
        pending = {sh.index for sh in self.shards}
        if draft is not None and self.draft is not None:
            msg, frames = draft if isinstance(draft, tuple) else (draft, ())
            send(self.draft.sock, {**msg, "sid": sid}, frames)
            pending.add(-1)
        replies: dict[int, dict[str, Any]] = {}
        if deadline is None:
            deadline = time.monotonic() + self.config.step_timeout
        draft_deadline = None
        while pending:
            if pending == {-1} and draft_deadline is None:  # the shards are done: the draft's
                # part is as quick; a silent draft (no heartbeats on one host) only loses
                # speculation, after step_deadline_min
                draft_deadline = min(deadline, time.monotonic() + self.config.step_deadline_min)
            try:  # a draft that fails or times out here only stops speculation
                msg, _ = self._wait(lambda s, m: m["type"] == "ok" and m.get("sid") == sid,
                                    draft_deadline or deadline, what, sid,
                                    on_draft=-1 in pending, blame_draft=lambda: pending == {-1})
            except (DraftError, DraftLost) as e:  # the draft's part failed: not the shards'
                log.warning("%s: %s", what, e)
                pending.discard(-1)
                continue
            pending.discard(msg["_shard"])
            replies[msg["_shard"]] = msg
        return [replies[i] for i in sorted(replies, key=lambda i: (i < 0, i))]

    def kv_swap(self, direction: str, pairs: Sequence[Sequence[int]]) -> None:
        """Copy blocks between every shard's device KV pool and its host pool (`direction`
        "out": device -> host, "in": host -> device), for each [device block, host block];
        returns once every shard has its copies queued (done, on a CPU; on a GPU the steps sent
        after this run after them: `shards.host_kv`) (swap preemption, `runtime.batching`)."""
        msg = message("kv_swap", direction=direction, pairs=[list(p) for p in pairs])
        self.call_all(lambda sh: msg)

    def shard_info(self) -> list[dict[str, Any]]:
        return [dict(sh.info) for sh in self.shards]

    def shard_busy_s(self) -> list[float]:
        """Seconds each shard has spent on steps so far (a utilization profile)."""
        self._ensure_up()
        deadline = time.monotonic() + self.config.step_timeout
        return [float(self._call(sh, message("ping"), deadline).get("busy_s", 0.0))
                for sh in self.shards]

    # ---- messaging ----------------------------------------------------------------------------
    def _handshake(self, sh: _Shard, deadline: float) -> None:
        nonce = auth.new_nonce()
        try:
            reply = self._call(sh, message("hello", nonce=nonce, role="coordinator"), deadline)
        except ShardFailure as e:
            if sh.proc is None and "no answer" in str(e):
                raise ShardFailure(f"remote shard {sh.index} at {sh.address} did not answer; "
                                   "is `layersplit shard` running there and reachable, with "
                                   "the same shared secret?") from e
            raise
        if reply["type"] != "challenge":
            raise ShardFailure(f"shard {sh.index} at {sh.address}: unexpected {reply['type']}")
        mac = auth.mac(self.secret, reply["nonce"], nonce, "coordinator")
        reply = self._call(sh, message("auth", mac=mac), deadline)
        if reply["type"] != "welcome":
            raise ShardFailure(f"shard {sh.index} at {sh.address}: handshake failed")
        sh.welcomed = True
        sh.host = reply["host"]
        sh.local = reply["host"] == self.host
        planned = self.placement.shards[sh.index]
        want = [planned.start, planned.end]
        if reply["layers"] != want:
            raise ShardFailure(
                f"shard {sh.index} at {sh.address} holds layers {reply['layers'][0]}:"
                f"{reply['layers'][1]}, but the placement wants {want[0]}:{want[1]}; start it "
                f"with --layers {want[0]}:{want[1]}")

    def _new_sid(self) -> int:
        self._sid += 1
        return self._sid

    def _call(self, sh: _Shard, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        sid = self._new_sid()
        send(sh.sock, {**msg, "sid": sid})
        reply, _ = self._wait(lambda s, m: s is sh, deadline, f"{msg['type']} to {_name(sh)}",
                              sid, on_draft=sh.index < 0)
        return reply

    def _drain(self, wait_ms: int = 0) -> None:
        """Handle messages nobody waits for: finished saves; stale replies (e.g. to a rejected
        stray frame) are discarded before a new operation."""
        if wait_ms:
            self._poller.poll(wait_ms)
        for sh in self.shards + ([self.draft] if self.draft is not None else []):
            while not sh.sock.closed and sh.sock.poll(0):  # (a draft lost meanwhile: closed)
                _, msg, frames, err = recv(sh.sock)
                if err is None and msg["type"] == "saved" and self.cache is not None:
                    self.cache.on_saved(sh.index, msg, frames)
                    continue
                if err is None and msg["type"] == "wake":
                    continue
                if err is None and self._stash(sh, msg, frames):
                    continue
                if err is None and msg["type"] == "error" and msg["code"] == "feed_lost":
                    self._lose_draft(msg["message"])
                    continue
                log.warning("%s: discarding stale %s", _name(sh),
                            err if err is not None else msg.get("message", msg["type"]))

    def _stash(self, sh: _Shard, msg: dict[str, Any], frames: Any) -> bool:
        """Keep the result (or the error) of a step in flight for `step_outputs`; False if the
        message is about something else."""
        sid = msg.get("sid")
        if sh.index < 0 or sid not in self._in_flight:
            return False
        _, t0, kind, nseg, rows = self._in_flight[sid]
        if msg["type"] == "result" and sh is self.shards[-1]:
            if self.trace is not None:
                self.trace("result", sid)
            self.deadlines.observe(kind, rows, time.perf_counter() - t0)
            t = frames if frames is None or isinstance(frames, torch.Tensor) else \
                zmq_tensor(msg, frames)
            self._done[sid] = (msg, None if t is None else t.clone(), nseg)
        elif msg["type"] == "error" and msg["code"] != "feed_lost":
            self._done[sid] = ShardFailure(msg["message"], runtime_down=False)
            self._void(sid)
        else:
            return False
        del self._in_flight[sid]
        self._back.append(sid)
        if self.step_observer is not None and msg["type"] == "result":
            self.step_observer(kind, time.perf_counter() - t0)
        return True

    def _void(self, sid: int) -> None:
        """A step failed on a split runtime that decodes ahead: the first shard may hold the
        lookahead step that takes its tokens (`ipc.token_board`), which now fails at once."""
        if not self.board or self.shards[0].sock.closed:
            return
        try:
            send(self.shards[0].sock, message("void", sid=sid))
        except zmq.ZMQError as e:
            log.warning("could not tell the first shard step %d failed (%s): a lookahead "
                        "step behind it fails after its wait", sid, e)

    def _wait(self, match, deadline: float, what: str, sid: int | None = None,
              on_draft: bool = False, blame_draft=lambda: True,
              until=None, step: int | None = None) -> tuple[dict[str, Any], Any] | None:
        """Poll every shard socket (and the draft's) until `match(shard, msg)`; raise on any
        failure.

        An error reply fails the operation if it names this op's `sid` or no sid at all; an
        error of another (earlier) op is logged and skipped. A dead or unreachable shard fails
        the whole runtime. A dead draft only stops speculation: DraftLost is raised when this
        op waits on the draft (`on_draft`), else the wait goes on; so does the deadline, when
        only the draft's answer is missing (`blame_draft()`). Results and errors of steps in
        flight are kept for `step_outputs` on the way; with `until`, the wait ends (None) as soon
        as `until()` holds. `step`: the step in flight whose deadline this is (for the message
        when it is missed)."""
        poller = self._poller
        ring = self._results
        last = self.shards[-1] if self.shards else None
        spin_until = time.monotonic() + self.spin_ms / 1000.0
        next_check = 0.0
        seen_draft: Any = False  # the draft the maps below were built with
        while True:
            if self.draft is not seen_draft:  # built again only when the draft is lost
                seen_draft = self.draft
                members = self.shards + ([self.draft] if self.draft is not None else [])
                by_sock = {sh.sock: sh for sh in members}
                by_mon = {sh.monitor: sh for sh in members}
            if until is not None and until():
                return None
            if ring is not None and ring.ready():
                got = self._ring_message(ring)
                if got is not None and not self._stash(last, *got) and match(last, got[0]):
                    return got
                continue
            now = time.monotonic()
            if now >= next_check:
                self._check_alive(on_draft)
                next_check = now + POLL_MS / 1000.0
            left = deadline - now
            if left <= 0:
                if on_draft and blame_draft():
                    self._lose_draft(f"no answer to {what} within the time limit")
                    raise DraftLost(f"no answer to {what} within the time limit")
                raise self.fail(self._late(what, step))
            if now < spin_until:
                timeout = 0
            else:
                timeout = min(SLEEP_POLL_MS if ring is not None else POLL_MS,
                              max(1, int(left * 1000)))
                if ring is not None:  # announce sleep, then look once more
                    ring.sleep(True)
                    if ring.ready():
                        ring.sleep(False)
                        continue
            events = poller.poll(timeout)
            if ring is not None and timeout:
                ring.sleep(False)
            for sock, _ in events:
                if sock in by_mon:
                    recv_monitor_message(sock)
                    sh = by_mon[sock]
                    why = (f"lost the connection to {_name(sh)} at {sh.address} (it closed, "
                           f"or left heartbeats unanswered for {self.config.heartbeat_timeout} "
                           "s: heartbeat_timeout)" if sh.proc is None else
                           f"lost the connection to {_name(sh)} (it closed its socket)")
                    if not sh.welcomed and needs_curve(sh.address):
                        # CurveZMQ drops a handshake sealed to another key without a word
                        why = (f"{_name(sh)} at {sh.address}: authentication failed: the "
                               "encrypted channel did not open (a wrong shared secret, or no "
                               "layersplit shard there); give both ends the same --secret-file")
                    if sh.proc is not None:  # a local process: say how it died, if it did
                        try:
                            sh.proc.proc.wait(0.5)
                        except Exception:  # noqa: BLE001 - still running: it hangs, or exits
                            pass
                        self._check_alive(on_draft)
                        said = sh.proc.error_text()  # (written before it exits)
                        if said:
                            why = f"{sh.proc.name} failed: {said}"
                    if sh.index < 0:
                        self._draft_failed(why, on_draft)
                        break  # the poller changed
                    raise self.fail(why)
                sh = by_sock.get(sock)
                if sh is None:  # a draft dropped earlier in this batch of events
                    continue
                _, msg, frames, err = recv(sock)
                if err is not None:
                    why = f"{_name(sh)} sent a malformed message: {err}"
                    if sh.index < 0:
                        self._draft_failed(why, on_draft)
                        break
                    raise self.fail(why)
                if msg["type"] == "wake":
                    continue
                if msg["type"] == "saved" and self.cache is not None:
                    self.cache.on_saved(sh.index, msg, frames)
                    continue
                msg["_shard"] = sh.index
                if self._stash(sh, msg, frames):
                    continue
                if msg["type"] == "error":
                    err_sid = msg.get("sid")
                    mine = sid is not None and err_sid == sid
                    if sh.index < 0:
                        if mine:
                            raise DraftError(msg["message"])
                        log.warning("%s", msg["message"])
                        continue
                    if msg["code"] == "feed_lost":  # a shard could not hand the draft its rows
                        self._lose_draft(msg["message"])
                        break  # the draft's socket, maybe among these events, is closed
                    if err_sid is not None and err_sid in self._back:
                        # a second report of a step that failed already (shards behind a zmq
                        # edge also pass their errors back upstream)
                        log.debug("%s: %s", _name(sh), msg["message"])
                        continue
                    if mine or msg["code"] == "bad_upstream":
                        raise self.fail(msg["message"], keep_running=True)
                    # an error about some other (earlier, or unreadable) message: not this op's
                    log.warning("shard %d: %s", sh.index, msg["message"])
                    continue
                if match(sh, msg):
                    return msg, zmq_tensor(msg, frames) if msg["type"] == "result" else frames
                log.debug("ignoring %s from %s while waiting for %s", msg["type"], _name(sh),
                          what)

    def _late(self, what: str, step: int | None) -> str:
        """Why a wait ran out of time: the step's deadline, and the local processes that are
        stopped (SIGSTOP, a debugger), when some are."""
        if step in self._in_flight:
            _, _, kind, _, rows = self._in_flight[step]
            why = (f"{what} ({kind}, {rows} rows) missed its deadline of "
                   f"{self.deadlines.describe(kind, rows)}")
        else:
            why = f"no answer to {what} within the time limit (step_timeout / startup_timeout)"
        stopped = [p.name + f" (pid {p.pid})" for p in self.procs if p.stopped()]
        if stopped:
            return f"{why}: {', '.join(stopped)} is stopped and hung"
        return f"{why}: a shard is hung or far slower than before"

    def _draft_failed(self, why: str, on_draft: bool) -> None:
        self._lose_draft(why)
        if on_draft:
            raise DraftLost(why)

    def _ring_message(self, ring: RingInbox) -> tuple[dict[str, Any], Any] | None:
        try:
            got = ring.poll()
        except ProtocolError as e:
            raise self.fail(f"malformed result from the last shard: {e}") from None
        if got is None:
            return None
        msg, t, seq = got
        t = None if t is None else t.clone()  # the slot is released now
        ring.release(seq)
        return msg, t

    def check_alive(self) -> None:
        """Notice a local process that died while nothing waited on it (an idle server calls
        this): a dead shard marks the runtime failed (`failed`), a dead draft stops
        speculation."""
        if self.failed is None and self.shards:
            try:
                self._check_alive()
            except ShardFailure:
                pass

    def _check_alive(self, on_draft: bool = False) -> None:
        for p in self.procs:
            why = p.failure()
            if why is not None:
                raise self.fail(why)
        why = self.ray.failure() if self.ray is not None else None
        if why is not None:
            raise self.fail(why)
        if self.draft is not None and self._draft_proc is not None:
            why = self._draft_proc.failure()
            if why is None and self._draft_proc.stopped():
                # the draft is optional: one that is stopped (SIGSTOP, a debugger) for
                # DRAFT_STOPPED_S costs speculation now rather than a step's whole deadline
                now = time.monotonic()
                self._draft_stopped_since = self._draft_stopped_since or now
                if now - self._draft_stopped_since >= DRAFT_STOPPED_S:
                    why = (f"{self._draft_proc.name} (pid {self._draft_proc.pid}) is stopped "
                           f"and has not answered for {DRAFT_STOPPED_S:.0f} s")
            elif why is None:
                self._draft_stopped_since = None
            if why is not None:
                self._draft_failed(why, on_draft)

    def fail(self, why: str, keep_running: bool = False) -> ShardFailure:
        """Record a failure; unless it is a recoverable request error, stop all shards."""
        if keep_running:
            return ShardFailure(why, runtime_down=False)
        self.failed = why
        log.error("shard failure: %s; stopping all shards", why)
        self.close()
        return ShardFailure(why)

    def _ensure_up(self) -> None:
        if self.failed is not None:
            raise ShardFailure(f"the runtime is down: {self.failed}")
        if not self.shards:
            raise ShardFailure("the runtime is not started")

    # ---- steps ----------------------------------------------------------------------------------
    def send_step(self, segs: Sequence[tuple[int, StepRequest, int | None]]) -> int:
        """Send one step, a segment per (KV slot, request, draft context it feeds or None);
        returns its sid. Its outputs are collected with `wait_steps` and `step_outputs`."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        wire, ids, late = [], [], []
        sched = self.batcher.sched
        for k, (slot, r, feed) in enumerate(segs):
            feed = feed if self.feeding else None
            extra = r.extra
            if r.sample is not None and extra is not None and LATE_MASK in extra:
                late.append((k, r, extra[LATE_MASK]))  # (computed once the step is on its way)
                extra = {**extra, LATE_MASK: True}
            sample = None if r.sample is None else {**r.sample.wire(), "seed": r.seed,
                                                    **(extra or {})}
            ask = None
            if r.ask is not None and feed is not None:  # the proposal of the last verdict
                ask = {**r.ask, "after": self._feat_sids.get(feed, 0)}
            if feed is not None:
                self._feat_sids[feed] = sid
            wire.append(segment(slot, r.pos, len(r.tokens), sample, r.want_logits,
                                None if r.draft is None else [int(t) for t in r.draft], feed,
                                r.tree, r.kept, r.then if feed is not None else None, ask,
                                r.plp, sched.table_update(slot), sched.copy_update(slot),
                                r.q, r.prev))
            ids.extend(r.tokens)
        first = segs[0][1]
        kind = ("verify" if first.draft is not None or first.ask is not None else
                "prefill" if len(first.tokens) > 1 else "decode")
        rows = sum(r.rows for _, r, _ in segs)
        if self.trace is not None:  # (as it goes: the first shard may take it first)
            self.trace("send", sid, kind=kind, rows=rows, seqs=len(wire))
        self._steps.send(message("step", sid=sid, seqs=wire, act=None),
                         torch.tensor(ids, dtype=torch.int64))
        ahead = [(d, k, n) for d, _, k, _, n in self._in_flight.values()]
        self._in_flight[sid] = (self.deadlines.deadline(kind, rows, time.monotonic(), ahead),
                                time.perf_counter(), kind, len(wire), rows)
        for k, r, make_mask in late:  # while the shards run the step
            try:
                mask = make_mask()
            except Exception as e:  # noqa: BLE001 - that sequence fails (`Batcher._send`)
                mask, r.error = None, e
            send(self.shards[-1].sock, message("mask", sid=sid, seg=k, mask=mask))
        return sid

    def forward(self, tokens: Sequence[int], pos: int, sample: SamplingParams | None, seed: int,
                want_logits: bool = False, draft: Sequence[int] | None = None,
                tree: Sequence[int] | None = None, kept: Sequence[int] | None = None,
                slot: int = 0) -> StepOutput:
        """One step of one sequence in `slot`, waited for (the `runtime.generate.Engine`
        protocol: traces and tests drive single steps with it)."""
        req = StepRequest(list(tokens), pos, sample, seed, want_logits,
                          None if draft is None else list(draft),
                          tree=None if tree is None else list(tree),
                          kept=None if kept is None else list(kept))
        try:  # (a slot driven here, outside admission: its table grows as it goes)
            self.batcher.sched.hold_slot(slot, pos + req.rows, new=pos == 0)
        except MemoryError as e:
            raise ValueError(f"step at {pos} of slot {slot}: {e}") from None
        sid = self.send_step([(slot, req, 0 if self.feeding else None)])
        if sid not in self._done:
            self._wait(lambda s, m: False, self._in_flight[sid][0], f"step {sid}", sid,
                       until=lambda: sid in self._done, step=sid)
        return self.step_outputs(sid)[0]

    def table_update(self, slot: int) -> dict[str, Any] | None:
        """The block-table change a message about `slot` carries (`runtime.scheduler`)."""
        return self.batcher.sched.table_update(slot)

    def feat_sid(self, context: int) -> int:
        """The last step that sent feature rows to the draft's `context` (a proposal or a
        snapshot of its sequence waits for them)."""
        return self._feat_sids.get(context, 0)

    def wait_steps(self) -> list[int]:
        """Wait until at least one step in flight is back; returns the sids of those back."""
        self._ensure_up()
        if not self._done and self._in_flight:
            oldest = min(self._in_flight)
            self._wait(lambda s, m: False, self._in_flight[oldest][0], f"step {oldest}",
                       until=lambda: bool(self._done), step=oldest)
        return list(self._done)

    def forget_steps(self, sids: Sequence[int] | None = None) -> None:
        """Drop what is known of these steps (all: the runtime is down); a late result of one
        is then discarded."""
        for sid in list(self._in_flight) + list(self._done) if sids is None else sids:
            self._in_flight.pop(sid, None)
            self._done.pop(sid, None)
            self._back.append(sid)

    def step_outputs(self, sid: int) -> list[StepOutput]:
        """The outputs of a step that is back, one per segment; raises its failure."""
        got = self._done.pop(sid)
        if isinstance(got, ShardFailure):
            raise got
        msg, logits, nseg = got
        if len(msg["outs"]) != nseg:
            raise self.fail(f"the last shard returned {len(msg['outs'])} outcomes for a step of "
                             f"{nseg} sequences")
        outs, row = [], 0
        for o in msg["outs"]:
            lg = None
            if o["logits"]:
                if logits is None or row >= len(logits):
                    raise self.fail("the last shard sent a result without its logits")
                lg = logits[row].numpy().copy()
                row += 1
            path = o["path"]
            if path is not None and (len(path) != o["accepted"] or not all(
                    isinstance(j, int) for j in path)):
                raise self.fail(f"the last shard returned the tree path {path[:40]} for "
                                 f"{o['accepted']} kept tokens")
            outs.append(StepOutput(o["token"], lg, o["accepted"], path, o["asked"], o["lp"],
                                   o["plp"]))
        if logits is not None and row != len(logits):
            raise self.fail(f"the last shard returned {len(logits)} logits rows for {row}")
        return outs

    def sample_logits(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int) -> int:
        return self.sample_output(logits, position, sample, seed).token

    def sample_output(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int, extra: dict | None = None) -> StepOutput:
        """Draw the token at `position` from stored logits on the last shard (an exact
        prefix-cache hit), with the optional sample fields `extra` (`shards.sampling`)."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        last = self.shards[-1]
        if extra is not None and LATE_MASK in extra:  # (nothing runs first: the mask goes with it)
            extra = dict(extra)
            mask = extra.pop(LATE_MASK)()
            if mask is not None:
                extra["mask"] = mask
        send(last.sock, message("sample", sid=sid, position=position,
                                sample={**sample.wire(), "seed": seed, **(extra or {})}),
             [np.ascontiguousarray(logits, dtype=np.float32)])
        msg, _ = self._wait(lambda s, m: s is last and m["type"] == "result" and m["sid"] == sid,
                            time.monotonic() + self.config.step_timeout, f"sample {sid}", sid)
        o = msg["outs"][0]
        return StepOutput(int(o["token"]), lp=o.get("lp"))

    # ---- generation ---------------------------------------------------------------------------
    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; max_context is "
                             f"{self.config.max_context}")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary")

    def submit(self, prompt: Sequence[int], params: SamplingParams, progress: Progress,
               use_cache: bool = True, speculative: bool | None = None,
               decoding: Decoding | None = None) -> Request:
        """Queue one prompt in the batch (`batcher.run_once` then runs it); its tokens appear
        in the request's `tokens` as they are generated. `decoding`: logprobs and logits
        processors (`runtime.decoding`); the logprobs land in `progress`."""
        self._ensure_up()
        self.check_prompt(prompt)
        if self.tokenizer is None and params.stop:
            raise ValueError(f"{self.model_path} has no tokenizer, so stop strings cannot apply")
        if self.config.spec_required and self.draft_path is not None and self.draft is None:
            # the runtime is down without its draft: a server restarts the group, draft included
            raise self.fail(f"speculation is required (spec_required) but the draft is gone: "
                             f"{self.draft_down}")
        prompt = list(prompt)
        if decoding is not None and decoding.prompt_logprobs is not None:
            use_cache = False  # every prompt row is computed: a restored one has no logprobs
        if decoding is not None and decoding.processes:
            if speculative is not False and self.draft is not None:
                log.info("a request is not speculated: its %s change the logits (each row of "
                         "a verify step would need processors of its own)",
                         ", ".join(decoding.processors))
            speculative = False
        holder: list[Request] = []
        seed = params.seed if params.seed is not None else new_seed()  # (kept on preemption)

        def make(slot: int) -> Program:
            """The sequence's program from its prompt and what it generated so far (a
            preempted sequence runs again from both: `runtime.batching`)."""
            done = list(progress.generated)
            dec = decoding
            if done and dec is not None and dec.prompt_logprobs is not None:
                dec = dataclasses.replace(dec, prompt_logprobs=None)  # (sent already)
            elif not done:  # (preempted before its first token: its prompt runs again whole)
                progress.prompt_logprobs.clear()
                if progress.logits is not None:
                    progress.logits.clear()
            return self._program(holder[0], prompt + done, params, progress, use_cache,
                                 speculative, slot, dec, seed, holder[0].shared)

        # a request that takes nothing from the cache takes no live prefix either (every row
        # of a prompt-logprobs request, or of one asked to run alone, is computed)
        cached = (None if not use_cache else
                  self.cache.cached_rows if self.cache is not None else lambda _: 0)
        req = self.batcher.submit(len(prompt), make,
                                  OutputStream(self.tokenizer, params, self.eos_ids, progress),
                                  prompt, cut_points(prompt, self.chunk, self.eos_ids), cached)
        holder.append(req)
        return req

    def deltas(self, req: Request) -> Iterator[Delta]:
        """The request's text deltas as the batch produces them (running the batch meanwhile);
        closing the iterator cancels the request."""
        try:
            while True:
                while not req.deltas and not req.done:
                    self.batcher.run_once()
                if req.deltas:
                    yield req.deltas.popleft()
                elif req.error is not None:
                    raise req.error
                else:
                    return
        finally:
            if self.batcher is not None:
                self.batcher.cancel(req)

    def stream(self, prompt: Sequence[int], params: SamplingParams, progress: Progress,
               use_cache: bool = True, speculative: bool | None = None) -> Iterator[Delta]:
        """Generate for one prompt; text deltas are yielded (see `_program`)."""
        return self.deltas(self.submit(prompt, params, progress, use_cache, speculative))

    def _program(self, req: Request, prompt: list[int], params: SamplingParams,
                 progress: Progress, use_cache: bool, speculative: bool | None,
                 slot: int, decoding: Decoding | None = None,
                 seed: int | None = None, shared: int = 0) -> Program:
        """One request in KV slot `slot`: restore its longest cached prefix, prefill the rest in
        chunks (snapshotting at its cache points), then decode, speculatively when the draft
        serves (unless `speculative` is False) and fewer than `spec_max_seqs` sequences feed
        it already; a feeding sequence sends the draft its rows, in its slot."""
        if seed is None:
            seed = params.seed if params.seed is not None else new_seed()
        # up to spec_max_seqs sequences at a time feed the draft their rows and speculate (each
        # with its own draft context, in its slot; one asked not to speculate still feeds it,
        # so its cache entries carry feature rows, and so does a sampled one under spec_sampling
        # `off`: a prefix it caches first restores into a greedy request that speculates at
        # once); the others decode plainly in the same steps
        context = (self._free_contexts.pop(0) if self.draft is not None and
                   self._free_contexts else None)
        prog = None
        try:
            drafter = None
            mode = self.spec_sampling_mode()
            if context is not None and speculative is not False and \
                    (params.greedy or mode != "off"):
                progress.spec = SpecStats()
                sample = (None if params.greedy or mode == "guesses" else
                          {**params.wire(), "seed": seed, "mode": mode})
                drafter = DraftClient(self, progress.spec, self.config.spec_required, context,
                                      sample)
                drafter.begin()
            elif context is not None:  # it only feeds: its context starts afresh all the same
                try:
                    self.draft_request(message("draft_begin", slot=context, sample=None))
                except (DraftLost, DraftError) as e:
                    log.warning("the draft did not start a context for this request: %s", e)
            cache = self.cache if use_cache else None
            restored = Restored()
            points: list[int] = []
            if shared:  # rows [0, shared) are another live sequence's blocks (`runtime.batching`)
                restored = Restored(length=shared, features=False)
            if cache is not None and shared:
                cuts = cut_points(prompt, self.chunk, self.eos_ids)
                last_cut = max([c for c in cuts if c <= len(prompt)], default=0)
                points = sorted({p for p in (last_cut, len(prompt)) if p > shared})
            elif cache is not None:
                cuts = cut_points(prompt, self.chunk, self.eos_ids)
                restored = cache.restore(prompt, cuts, slot, context if self.feeding else None)
                progress.cached_tokens, progress.cache_tier = restored.length, restored.tier
                # snapshot at the last cut inside the prompt (restorable into any longer prompt)
                # and at its very end (an exact repeat then needs no forward pass)
                last_cut = max([c for c in cuts if c <= len(prompt)], default=0)
                points = sorted({p for p in (last_cut, len(prompt)) if p > restored.length})
            # the draft's context is whole if every row it needs came from this sequence's steps
            # or from the cache with its feature rows
            req.feed = context if self.feeding else None
            live = req.feed is not None and (restored.length == 0 or restored.features)
            if drafter is not None and (not drafter.active or (self.feeding and not live)):
                if drafter.active:
                    log.info("no speculation for this request: the restored prefix carries no "
                             "draft feature rows")
                drafter = None
            if req.feed is not None and not live:
                # its rows could not make the draft's context whole, nor its snapshots carry
                # them: the context goes back at once, for a request that can speculate
                self._give_back_context(context)
                context = req.feed = None
            parent = [restored.leaf]

            def on_boundary(end: int, logits: np.ndarray | None) -> None:
                if end in points:
                    e = cache.snapshot(prompt, end, logits, parent[0], slot,
                                       req.feed if live else None)
                    if e is not None:
                        parent[0] = e

            prog = sequence_program(prompt, params, seed, chunk=self.chunk,
                                    turn_end_ids=self.eos_ids, start=restored.length,
                                    start_logits=restored.logits,
                                    context=self.config.max_context,
                                    on_prefill_boundary=on_boundary if points else None,
                                    logits_at=points, drafter=drafter,
                                    on_logits=None if progress.logits is None
                                    else progress.logits.append,
                                    **self._decoding_hooks(decoding, prompt, params, progress))
            t_prefill = time.perf_counter()
            item = next(prog)
            while not isinstance(item, int):
                item = prog.send((yield item))
            if cache is not None:  # the first token is out: the prefill is done
                if restored.length < len(prompt):
                    cache.note_prefill(len(prompt), len(prompt) - restored.length,
                                       time.perf_counter() - t_prefill)
                cache.take_deferred(slot)
            while True:
                item = prog.send((yield item))
        except StopIteration:
            return
        finally:
            if prog is not None:
                prog.close()
            if self.cache is not None:  # a RAM copy its slot did not take (cancelled or
                # preempted before its first token) must not be taken by the slot's next sequence
                self.cache.drop_deferred(slot)
            if context is not None:
                self._give_back_context(context)

    def _decoding_hooks(self, d: Decoding | None, prompt: list[int], params: SamplingParams,
                        progress: Progress) -> dict[str, Any]:
        """`sequence_program`'s step_fields, on_output and prompt_lp for a request's `d`."""
        if d is None:
            return {}
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        # every sequence of a step, and the step's own fields, share one ring slot's header
        budget = (HEADER_CAP - 4096) // (self.config.max_seqs + 1)
        fields = StepFields(d, prompt, stops, self.model_config.vocab_size, budget)
        return {"step_fields": fields, "on_output": progress.note_output,
                "prompt_lp": None if d.prompt_logprobs is None else {
                    "k": d.prompt_logprobs, "temperature": params.temperature}}

    def generate(self, prompt: Sequence[int], params: SamplingParams, use_cache: bool = True,
                 speculative: bool | None = None) -> GenerationResult:
        progress = Progress()
        return collect(self.stream(prompt, params, progress, use_cache, speculative), progress,
                       len(prompt))

    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       params: Sequence[SamplingParams], use_cache: bool = True,
                       speculative: Sequence[bool | None] | None = None,
                       progress: Sequence[Progress] | None = None) -> list[GenerationResult]:
        """Generate for several prompts at once (one continuous batch); results in order
        (`progress`, when given, one per prompt, gets each one's timings)."""
        spec = list(speculative) if speculative is not None else [None] * len(prompts)
        progs = list(progress) if progress is not None else [Progress() for _ in prompts]
        for p in prompts:  # every prompt is checked before any is queued
            self.check_prompt(p)
        reqs: list[Request] = []
        try:
            for p, sp, pr, s in zip(prompts, params, progs, spec, strict=True):
                reqs.append(self.submit(p, sp, pr, use_cache, s))
        except BaseException:
            for r in reqs:
                self.batcher.cancel(r)
            raise
        streams = [self.deltas(r) for r in reqs]
        live = list(range(len(streams)))
        try:
            while live:  # each pull runs the batch until that stream has a token
                for i in list(live):
                    if next(streams[i], None) is None:
                        live.remove(i)
        finally:
            for st in streams:
                st.close()
            for r in reqs:  # (a stream never started does not cancel its request on close)
                self.batcher.cancel(r)
        return [collect(iter(()), pr, len(p)) for p, pr in zip(prompts, progs, strict=True)]
