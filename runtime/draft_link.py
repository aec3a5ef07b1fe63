"""The draft process as the coordinator sees it: where it runs, starting and configuring
it, its requests, and losing it (speculation then stops; the target goes on).

`DraftLink` is one part of `runtime.coordinator.Coordinator` (its state is set in
`Coordinator.__init__`); the drafters reach it through `runtime.speculative.DraftHost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from layersplit.ipc import auth
from layersplit.ipc.messages import message
from layersplit.ipc.sockets import close_monitored, connect_dealer, free_tcp_port, send
from layersplit.runtime.errors import DraftError, DraftLost, ShardFailure, draft_not_started
from layersplit.runtime.placement import Placement, PlacementError, ShardPlan, check_local_devices
from layersplit.runtime.shard_group import _Shard
from layersplit.runtime.spec_policy import SpecPolicy, policy_sizes
from layersplit.runtime.speculative import draft_taps, spec_sampling_mode, verify_shape
from layersplit.runtime.supervisor import LocalProcess, draft_argv, spawn_draft, stop_all
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.errors import CheckpointError

log = logging.getLogger("layersplit.runtime.coordinator")  # (one name for the coordinator's parts)
DRAFT_TIMEOUT_S = 60.0  # a proposal (or the draft's part of a cache operation) never takes this


def check_same_vocab(draft: str | Path, target: TextTokenizer | None) -> None:
    """A classic draft must share the target's tokenizer (`target`, the coordinator's): the
    same tokens, the same ids (random weights have none: nothing to check)."""
    try:
        a = TextTokenizer.for_model(draft)
    except CheckpointError as e:
        raise CheckpointError(f"the classic draft {draft}: {e}") from None
    if a is None or target is None:
        return
    if a.tk.get_vocab() != target.tk.get_vocab():
        raise CheckpointError(f"{draft}: the draft's tokenizer differs from the target's; a "
                              "classic draft needs the same vocabulary")


class DraftLink:
    """The coordinator's side of the draft process. Owns `draft`, `draft_info`, `draft_down`,
    `push_drafts` and the free draft contexts."""

    def _check_draft_placement(self) -> None:
        """The draft process runs on this host: its device must be here, and the shards that
        feed it their rows too (`auto` gives up speculation when some shard is remote)."""
        if self.draft_path is None:
            return
        taps = draft_taps(self.draft_path)
        if not taps:  # (a classic draft; its process checks the vocabulary's size only)
            check_same_vocab(self.draft_path, self.tokenizer)
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
        if self.spec_policy is None and self.policy_measures:  # (kept across a restart of
            # the shard group: the same layout)
            block, tree = verify_shape(self.draft_info, self.config, max_step)
            self.spec_policy = SpecPolicy(policy_sizes(tree or block - 1),
                                          spec_seqs=self.config.spec_max_seqs)
        log.info("draft ready: %s on %s, %d tokens per verify step%s, %.0f MB",
                 self.draft_info["kind"], self.draft_info["device"],
                 self.draft_info["block_size"],
                 f", taps layers {taps}" if taps else "",
                 self.draft_info["memory_bytes"] / 2**20)
        return taps

    def _draft_warmed(self, deadline: float) -> None:
        """Wait for the draft's warm-up (compile, capture), which it began as the shards linked
        to it and ran while they warmed up: within the start's deadline, not the first
        request's; a failed one fails the start as a failed configure does."""
        if self.draft is None:
            if self.draft_path is not None:  # it died (or was lost) since its configure
                raise draft_not_started(self.draft_path, self.draft_down or "it is gone")
            return
        try:
            self._call(self.draft, message("draft_warm"), deadline)
        except (DraftLost, DraftError) as e:
            raise draft_not_started(self.draft_path, e) from None

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
            self.cache.saves.draft_lost()
        for sock in (d.sock, d.monitor):
            try:
                self._poller.unregister(sock)
            except KeyError:  # never registered: the draft failed while starting
                pass
        close_monitored(d.sock, d.monitor)
        if isinstance(self._draft_proc, LocalProcess):
            stop_all([self._draft_proc], grace_s=0.0, term_s=0.0)
        elif self._draft_proc is not None and self.ray is not None:
            self.ray.stop_draft()

    def _draft_failed(self, why: str, on_draft: bool) -> None:
        self._lose_draft(why)
        if on_draft:
            raise DraftLost(why)

    @property
    def feeding(self) -> bool:
        """Steps send tapped rows to the draft (a feature-conditioned draft serves)."""
        return self.draft is not None and bool(self.draft_info.get("taps"))

    @property
    def policy_measures(self) -> bool:
        """Whether the speculation policy chooses each step (`spec_policy`: measured, or auto
        where a GPU runs the target or the draft) rather than every step speculating."""
        setting = self.config.spec_policy
        devices = [s.device for s in self.placement.shards] + [self.draft_device]
        return setting == "measured" or (
            setting == "auto" and any(d.startswith("cuda") for d in devices))

    def spec_clock(self) -> tuple[int, int]:
        """(steps sent so far, sequences decoding now): the speculation policy's clock and the
        batch whose costs it measures (`runtime.spec_policy`)."""
        b = self.batcher
        return (0, 1) if b is None else (b.stats.steps, max(1, len(b.sched.running)))

    def spec_sampling_mode(self) -> str:
        """`spec_sampling` as it applies to this runtime's sampled requests
        (`runtime.speculative.spec_sampling_mode`: `auto` resolved by the devices, the
        draft's kind and the policy)."""
        devices = [s.device for s in self.placement.shards] + [self.draft_device]
        return spec_sampling_mode(self.config.spec_sampling, devices,
                                  self.draft_info.get("kind"), self.policy_measures)

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
