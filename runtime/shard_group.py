"""The shard group the coordinator supervises: start-up (processes, handshakes,
configuration, graph captures), liveness, failure and shutdown.

`ShardGroup` is one part of `runtime.coordinator.Coordinator` (its state is set in
`Coordinator.__init__`); `_Shard` is the coordinator's handle on one server process of the run.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from layersplit.ipc import auth
from layersplit.ipc.messages import message
from layersplit.ipc.sockets import (
    close_monitored,
    connect_dealer,
    free_tcp_port,
    ring_doorbell,
    run_dir,
    send,
)
from layersplit.ipc.transport import ZmqSender, accept, offer
from layersplit.runtime.batching import MAX_IN_FLIGHT, Batcher
from layersplit.runtime.cache_ops import CacheManager
from layersplit.runtime.errors import DraftError, DraftLost, ShardFailure, draft_not_started
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.kv_pool import host_pool_plan, kv_pool_blocks
from layersplit.runtime.resident_kv import admission_hint
from layersplit.runtime.scheduler import SchedulerConfig
from layersplit.runtime.speculative import tree_size, verify_shape, warm_verify_rows
from layersplit.runtime.supervisor import LocalProcess, drop_prestarted, spawn_shard, stop_all

if TYPE_CHECKING:
    from layersplit.runtime.ray_launcher import RayShard


log = logging.getLogger("layersplit.runtime.coordinator")  # (one name for the coordinator's parts)
CLOSE_DRAIN_S = 5.0  # at close, steps still in the chain get this long to come back
REMOTE_CONNECT_S = 30.0
DRAFT_STOPPED_S = 2.0  # a stopped draft process is dropped after this (speculation stops)
# whether the draft process is stopped is looked up at most this often: it reads /proc (tens of
# microseconds), and every step's wait checks the processes once (a decode step is ~0.65 ms)
STOPPED_CHECK_S = 0.05


def _name(sh: _Shard) -> str:
    return "the draft process" if sh.index < 0 else f"shard {sh.index}"


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


class ShardGroup:
    """The coordinator's supervision of its processes: `start` brings the chain up (shards,
    the draft, their rings and pools, the batch), `fail` and `close` take it down, and
    `check_alive` notices a process that died. Owns `shards`, `procs`, `failed`, `ray` and the
    run directory."""

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
        t0 = time.monotonic()  # (the deadlines below are `_wait`'s, on this clock)
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
                                   cfg.fork_cpu_processes, self.weight_format)
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
                raise draft_not_started(self.draft_path, e) from None
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
            # a token board the two share on one host); a hybrid model's too, whose recurrent
            # state never takes a row twice (`Batcher.recurrent`)
            ahead = cfg.decode_ahead and len(self.shards) > 1 and first.host == last.host
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
                                                cfg.max_seqs, None)
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
                if sh.info.get("dtype") != self.dtype:  # (a shard started by hand)
                    raise ShardFailure(f"{_name(sh)} computes in {sh.info.get('dtype')} where "
                                       f"this run computes in {self.dtype}: start it with "
                                       f"--dtype {self.dtype} (or give the run --dtype "
                                       f"{sh.info.get('dtype')})")
                theirs = sh.info.get("weight_format", "dequantize")
                if theirs != self.weight_format:  # (a shard started by hand)
                    raise ShardFailure(f"{_name(sh)} holds its weights {theirs} where this run "
                                       f"holds them {self.weight_format}: start it with "
                                       f"--weight-format {self.weight_format}")
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
            self._draft_warmed(t0 + cfg.startup_timeout)
            if cfg.prefix_cache:
                self.cache = CacheManager(self)
            groups = min(cfg.micro_batches or len(self.shards), cfg.max_seqs, MAX_IN_FLIGHT)
            self.batcher = Batcher(self, SchedulerConfig(
                slots=cfg.max_seqs, slot_tokens=cfg.max_context, block_tokens=cfg.kv_block,
                micro_batches=groups, step_tokens=max_step, num_blocks=self.kv_blocks),
                host_blocks=self.kv_host_blocks, host_pool=self.host_pool)
            # a hybrid model's sequence is also its recurrent state, which blocks do not hold
            self.batcher.share_prefixes = self.model_config.hybrid is None
            if self.cache is not None and self.model_config.hybrid is None:  # (entries' blocks
                self.cache.sched = self.batcher.sched  # stay in the pool: `runtime.resident_kv`)
                self.batcher.sched.resident_for = admission_hint(self.batcher, self.cache)
            self.batcher.recurrent = self.model_config.hybrid is not None
            self.batcher.look_ahead = cfg.decode_ahead and (len(self.shards) == 1 or self.board)
            if cfg.decode_ahead and len(self.shards) > 1 and first.host != last.host:
                log.info("decode lookahead off: the first and last shard are on different "
                         "hosts (they share no token board)")
        except BaseException:
            self.close()
            raise
        log.info("%d shards ready in %.1f s", len(self.shards), time.monotonic() - t0)

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
            sizes = self.spec_policy.sizes if self.spec_policy is not None else ()
            rows += warm_verify_rows(block, tree, sizes, self.model_config.hybrid is not None)
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
        states = [str(i.get("compile_cache", "off")) for i in self.warmed]
        if any(st != "off" for st in states):  # (`shards.compile_cache`)
            log.info("compile cache entries: %s", ", ".join(
                f"shard {k} {st}" for k, st in enumerate(states)))

    def warm_prefill_graphs(self) -> int:
        """Every shard captures its eager prefill steps' graphs, every row bucket
        (`shards.prefill_graphs`; serve, before ready: `runtime.engine`); returns the buckets
        captured (0 on CPU shards, and where the ranges do not take them)."""
        t0 = time.perf_counter()
        replies = self.call_all(lambda sh: message("warm_prefill"),
                                deadline=time.monotonic() + self.config.startup_timeout,
                                what="the prefill graphs' captures")
        buckets = sum(int(r["info"].get("buckets", 0)) for r in replies)
        if buckets:
            log.info("prefill graphs: %d row buckets captured in %.1f s", buckets,
                     time.perf_counter() - t0)
        return buckets

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
                                 t0 + self.config.startup_timeout, draft, self.weight_format)
        self.host = self.ray.host_id
        return started

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

    def shard_info(self) -> list[dict[str, Any]]:
        return [dict(sh.info) for sh in self.shards]

    def shard_busy_s(self) -> list[float]:
        """Seconds each shard has spent on steps so far (a utilization profile)."""
        self._ensure_up()
        deadline = time.monotonic() + self.config.step_timeout
        return [float(self._call(sh, message("ping"), deadline).get("busy_s", 0.0))
                for sh in self.shards]

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
            self.cache.saves.abandon()
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
            close_monitored(sh.sock, sh.monitor)
        self.shards, self.procs, self.draft, self._draft_proc = [], [], None, None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def _finish_saves(self, timeout_s: float) -> None:
        """Let pending cache writes complete (graceful shutdown)."""
        deadline = time.monotonic() + timeout_s
        cache = self.cache
        try:
            while cache.saves.pending() and time.monotonic() < deadline:
                self._drain(wait_ms=20)
                cache.saves.poll_done()
            cache.saves.poll_done()
        except ShardFailure:
            pass
        if cache.saves.pending():
            log.warning("prefix cache: %d saves still pending at shutdown; abandoned",
                        cache.saves.pending())

    def poll_saves(self) -> None:
        """Move pending cache writes on while nothing else drains the shards (an idle server
        calls this): the rows the shards stream back for a snapshot's file are taken in and
        finished files are renamed into place, so the entry a keep made just before the server
        went idle is on disk without waiting for the next request (a server killed while idle
        keeps it)."""
        cache = self.cache
        if cache is None or self.failed is not None or not self.shards or not cache.saves.pending():
            return
        try:
            self._drain(wait_ms=0)
            cache.saves.poll_done()
        except ShardFailure as e:  # (a dead shard: `failed` is set, and the engine recovers)
            if not e.runtime_down:
                log.warning("prefix cache: finishing saves while idle: %s", e)

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
            now = time.monotonic()
            if why is None and now < self._draft_stop_check:
                return
            self._draft_stop_check = now + STOPPED_CHECK_S
            if why is None and self._draft_proc.stopped():
                # the draft is optional: one that is stopped (SIGSTOP, a debugger) for
                # DRAFT_STOPPED_S costs speculation now rather than a step's whole deadline
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
